"""Which slots the running trials hold: the bookkeeping of
:class:`~toolkit.dsat.execution.runner.TrialRunner`.

Pure bookkeeping, no processes. One scheme per kind of machine, chosen by the settings:

* **hosts** (``--hostfile`` or a Slurm allocation): each host's free slot ids; a trial is placed
  with :func:`~toolkit.dsat.execution.hosts.place_trial` (a host's slots are not pooled with
  another's); a trial wholly on this machine with GPUs gets the slot ids as its GPU ids;
* **GPUs of this machine**: free GPU ids, handed out in order;
* **CPU slots of this machine**: counted only (``max_slots``), nothing to hand out.

Autotuner process only.

Example::

    pool = SlotPool(settings)
    held = pool.take(trial_id=3)          # Slots(gpus=(0, 1)), or a placement on hosts
    pool.give_back(held)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Mapping

from toolkit.dsat.execution.hosts import is_local_host, place_trial
from toolkit.dsat.execution.settings import RunnerSettings

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
    """The free slots of a run, for the scheme its settings imply (see the module)."""

    def __init__(self, settings: RunnerSettings) -> None:
        self.settings = settings
        self.free_gpus = list(settings.gpus) if settings.gpus is not None else None
        self.free_slots = ({h.name: tuple(range(h.slots)) for h in settings.hosts}
                           if settings.hosts is not None else None)

    def placeable(self, count: int) -> int:
        """How many of ``count`` more trials the hosts' free slots can place (``count`` without hosts)."""
        if self.free_slots is None:
            return count
        s = self.settings
        free, placed = dict(self.free_slots), 0
        while placed < count:
            chosen = place_trial(free, s.slots_per_trial, uniform=s.multihost_launcher == "srun")
            if chosen is None:
                break
            free = _without(free, chosen)
            placed += 1
        return placed

    def take(self, *, trial_id: int) -> Slots:
        """Slots for one trial; RuntimeError if none are free (check :meth:`placeable` first)."""
        s = self.settings
        if self.free_slots is not None:
            placement = place_trial(self.free_slots, s.slots_per_trial,
                                    uniform=s.multihost_launcher == "srun")
            if placement is None:
                raise RuntimeError(f"trial {trial_id} does not fit the free slots {self.free_slots}")
            self.free_slots = _without(self.free_slots, placement)
            if not all(is_local_host(h) for h in placement):
                return Slots(placement=placement, via=s.multihost_launcher)
            if s.gpus is not None and len(placement) == 1:  # this machine: slot ids are its GPU ids
                return Slots(gpus=next(iter(placement.values())), placement=placement)
            return Slots(placement=placement)
        if self.free_gpus is not None:
            n = s.slots_per_trial
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
