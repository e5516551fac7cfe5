"""Inside the profiling trial: each rank measures the model and its memory during the first step
(:class:`ProfileProbe`), and the chief merges them (:func:`merge_profiles`) for the memory model.
Every rank, no collective. Design: docs/design-dsat-search.md#inside-a-trial.
"""

from __future__ import annotations

import math
import os
from typing import Any

from toolkit.dsat.contract import ProfileInfo

__all__ = ["ProfileProbe", "measure_profile", "merge_profiles", "peak_memory_bytes", "reset_peak_memory",
           "rss_bytes", "state_bytes"]


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident size (``VmRSS``) or its peak so far (``VmHWM``), in bytes. Any rank."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not Linux: the peak is the best available
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_bytes(device: Any) -> int:
    """This rank's peak memory so far, as the budget is held: on CUDA the peak reserved plus what
    PyTorch does not hold (context, NCCL); on CPU the peak resident size (VmHWM). Any rank."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside = max(total - free - torch.cuda.memory_reserved(device), 0)
        return int(torch.cuda.max_memory_reserved(device)) + int(outside)
    return rss_bytes("VmHWM")


def reset_peak_memory(device: Any) -> None:
    """Start :func:`peak_memory_bytes` afresh before the first step, so that the peak is the steps'
    (CUDA's peak stats; on Linux ``/proc/self/clear_refs``; else nothing). Any rank."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        pass


def _numel(p: Any) -> int:
    # ZeRO-3 leaves an empty placeholder in p and records the full size in ds_numel.
    return int(getattr(p, "ds_numel", p.numel()))


def _output_bytes(obj: Any, seen: set[int]) -> int:
    """Bytes of the tensors in a module's output, each storage once (``seen``: storages counted)."""
    import torch
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_output_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_output_bytes(x, seen) for x in obj.values())
    return 0


def state_bytes(engine: Any) -> int:
    """Bytes of the model state tensors on the engine: parameters, ZeRO partitions, grads, optimizer."""
    import torch
    found: list[torch.Tensor] = []

    def walk(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            found.extend(t for t in (obj, getattr(obj, "grad", None), getattr(obj, "ds_tensor", None))
                         if isinstance(t, torch.Tensor))
        elif isinstance(obj, torch.optim.Optimizer):  # its state: {param: {"exp_avg": tensor, ...}}
            walk(list(obj.state.values()), 2)
        elif depth > 0 and isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth - 1)
        elif depth > 0 and isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth - 1)

    walk(list(engine.module.parameters()), 1)
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None:  # a torch optimizer, or DeepSpeed's ZeRO / fp16 wrapper holding one
        walk(optimizer, 0)
        walk(dict(vars(optimizer)), 3)
    storages: dict[int, int] = {}
    for t in found:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class ProfileProbe:
    """Forward hooks on the engine's leaf modules for one step: the activation bytes it makes. Made
    before the step; :meth:`measure` after it, :meth:`remove` alone when the step failed."""

    def __init__(self, engine: Any, *, forwards: int) -> None:
        import torch
        self.engine = engine
        self.forwards = forwards            # the engine's forward calls before the step
        self.activation_bytes = 0
        seen: set[int] = set()

        def hook(module: Any, inputs: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                self.activation_bytes += _output_bytes(output, seen)

        leaves = [m for m in engine.module.modules() if next(m.children(), None) is None]
        self.handles = [m.register_forward_hook(hook) for m in leaves]
        self.state_bytes = state_bytes(engine)

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def measure(self, *, forwards: int, memory_budget: int | None, local_world_size: int,
                rss_start: int) -> dict[str, Any]:
        """Remove the hooks; this rank's :class:`ProfileInfo` as JSON (see :func:`measure_profile`)."""
        self.remove()
        return measure_profile(self.engine, activation_bytes=self.activation_bytes,
                               forwards=forwards - self.forwards, state_bytes=self.state_bytes,
                               memory_budget=memory_budget, local_world_size=local_world_size,
                               rss_start=rss_start)


def measure_profile(engine: Any, *, activation_bytes: int, forwards: int, state_bytes: int,
                    memory_budget: int | None, local_world_size: int, rss_start: int) -> dict[str, Any]:
    """This rank's :class:`ProfileInfo` as JSON after the first step: parameters held, leaf outputs per
    example, memory per slot, baseline and peak (docs/design-dsat-search.md#inside-a-trial)."""
    import torch
    params = list(engine.module.parameters())
    device = torch.device(getattr(engine, "device", "cpu"))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        memory, baseline = total, max(total - free - torch.cuda.memory_reserved(device), 0)
    else:
        memory = memory_budget or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                   // max(local_world_size, 1))
        baseline = max(rss_bytes("VmHWM") - state_bytes - activation_bytes, rss_start - state_bytes, 0)
    examples = max(forwards, 1) * engine.train_micro_batch_size_per_gpu()
    half = bool(engine.fp16_enabled() or engine.bfloat16_enabled())
    return ProfileInfo(
        num_params=sum(_numel(p) for p in params),
        trainable_params=sum(_numel(p) for p in params if p.requires_grad),
        activation_bytes_per_example=math.ceil(activation_bytes / examples),
        memory_per_slot=int(memory), baseline_bytes=int(baseline), half_precision=half,
        device="cuda" if device.type == "cuda" else "cpu",
        micro_batch=engine.train_micro_batch_size_per_gpu(), peak_bytes=peak_memory_bytes(device)).to_json()


def merge_profiles(profiles: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The ranks' profiles as one: the rank that needs the most memory decides; the memory
    available is the smallest slot's. None when no rank measured one. Pure."""
    known = [p for p in profiles if p]
    if not known:
        return None
    merged = dict(known[0])
    for key in ("num_params", "trainable_params", "activation_bytes_per_example", "baseline_bytes",
                "peak_bytes", "startup_peak_bytes"):
        merged[key] = max(p.get(key, 0) for p in known)
    merged["memory_per_slot"] = min(p["memory_per_slot"] for p in known)
    return merged
