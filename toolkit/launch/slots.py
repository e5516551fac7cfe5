"""Which slots the running trials hold: the pool dsat's runner and ``python -m toolkit.run`` share.
Pure bookkeeping of hosts, GPUs or CPU slots (docs/design-dsat-runner.md#slots); the runner's process
only. Example::

    pool = SlotPool(slots_per_trial=2, gpus=(0, 1, 2, 3))
    held = pool.take(trial_id=3)          # Slots(gpus=(0, 1))
    pool.give_back(held)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Mapping

from toolkit.launch.hosts import Host, is_local_host, place_trial

__all__ = ["SlotPool", "Slots", "device_ids"]


@dataclasses.dataclass(frozen=True)
class Slots:
    """What one trial holds: GPU ids of this machine, or its placement on the hosts (and how it is
    launched there: None on this machine); all None for CPU slots, which are counted only."""

    gpus: tuple[int, ...] | None = None
    placement: dict[str, tuple[int, ...]] | None = None
    via: str | None = None


def device_ids(gpus: tuple[int, ...] | None) -> dict[int, str]:
    """gpus (this process's numbering) -> the values to put in a trial's CUDA_VISIBLE_DEVICES."""
    if gpus is None:
        return {}
    visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return {g: str(g) for g in gpus}
    missing = [g for g in gpus if g >= len(visible)]
    if missing:
        raise ValueError(f"gpus={gpus} but CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} makes "
                         f"only {len(visible)} GPU(s) visible (indices 0..{len(visible) - 1}); gpus are "
                         "indices into it")
    return {g: visible[g] for g in gpus}


def _without(free: Mapping[str, tuple[int, ...]], placement: Mapping[str, Iterable[int]]
             ) -> dict[str, tuple[int, ...]]:
    """``free`` (host -> slot ids) less the slots of ``placement``; a new dict. Pure."""
    return {h: tuple(i for i in ids if i not in placement.get(h, ())) for h, ids in free.items()}


class SlotPool:
    """The free slots of a run: ``hosts`` (placed across machines, launched there through
    ``multihost_launcher``), else ``gpus`` of this machine, else CPU slots (nothing to hand out)."""

    def __init__(self, *, slots_per_trial: int, gpus: tuple[int, ...] | None = None,
                 hosts: tuple[Host, ...] | None = None, multihost_launcher: str = "pdsh") -> None:
        self.slots_per_trial, self.multihost_launcher = slots_per_trial, multihost_launcher
        self.uniform = multihost_launcher == "srun"   # srun starts the same count on every host
        self.local_gpus = gpus is not None
        self.free_gpus = list(gpus) if gpus is not None else None
        self.free_slots = {h.name: tuple(range(h.slots)) for h in hosts} if hosts is not None else None

    def placeable(self, count: int) -> int:
        """How many of ``count`` more trials the hosts' free slots can place (``count`` without hosts)."""
        if self.free_slots is None:
            return count
        free, placed = dict(self.free_slots), 0
        while placed < count:
            chosen = place_trial(free, self.slots_per_trial, uniform=self.uniform)
            if chosen is None:
                break
            free = _without(free, chosen)
            placed += 1
        return placed

    def take(self, *, trial_id: int) -> Slots:
        """Slots for one trial; RuntimeError if none are free (check :meth:`placeable` first)."""
        if self.free_slots is not None:
            placement = place_trial(self.free_slots, self.slots_per_trial, uniform=self.uniform)
            if placement is None:
                raise RuntimeError(f"trial {trial_id} does not fit the free slots {self.free_slots}")
            self.free_slots = _without(self.free_slots, placement)
            if not all(is_local_host(h) for h in placement):
                return Slots(placement=placement, via=self.multihost_launcher)
            if self.local_gpus and len(placement) == 1:  # this machine: slot ids are its GPU ids
                return Slots(gpus=next(iter(placement.values())), placement=placement)
            return Slots(placement=placement)
        if self.free_gpus is not None:
            n = self.slots_per_trial
            gpus, self.free_gpus = tuple(self.free_gpus[:n]), self.free_gpus[n:]
            return Slots(gpus=gpus)
        return Slots()

    def give_back(self, slots: Slots) -> None:
        """Free what :meth:`take` handed out."""
        if slots.placement is not None and self.free_slots is not None:
            placement = slots.placement
            self.free_slots = {h: tuple(sorted(set(ids) | set(placement.get(h, ()))))
                               for h, ids in self.free_slots.items()}
        elif slots.gpus is not None and self.free_gpus is not None:
            self.free_gpus = sorted(self.free_gpus + list(slots.gpus))
