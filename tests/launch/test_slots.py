"""The slot pool dsat's runner and toolkit.run share (toolkit.launch.slots): GPUs handed out and
taken back, hosts placed and freed, CPU slots counted by the caller. Pure; no process."""

import pytest

from toolkit.launch.hosts import Host
from toolkit.launch.slots import SlotPool, Slots, device_ids


def test_gpus_are_handed_out_in_order_and_taken_back():
    pool = SlotPool(slots_per_trial=2, gpus=(0, 1, 2, 3))
    first, second = pool.take(trial_id=0), pool.take(trial_id=1)
    assert (first, second) == (Slots(gpus=(0, 1)), Slots(gpus=(2, 3)))
    assert pool.free_gpus == []
    pool.give_back(first)
    assert pool.take(trial_id=2) == Slots(gpus=(0, 1))
    assert pool.placeable(5) == 5  # without hosts the caller counts the slots


def test_cpu_slots_hand_out_nothing():
    pool = SlotPool(slots_per_trial=4)
    held = pool.take(trial_id=0)
    assert held == Slots() and held.gpus is None and held.placement is None
    pool.give_back(held)  # nothing to free


def test_hosts_are_placed_freed_and_counted():
    hosts = (Host("worker-0", 2), Host("worker-1", 2))
    pool = SlotPool(slots_per_trial=2, hosts=hosts)
    assert pool.placeable(3) == 2
    a = pool.take(trial_id=0)
    assert a.placement == {"worker-0": (0, 1)} and a.via == "pdsh" and a.gpus is None
    b = pool.take(trial_id=1)
    with pytest.raises(RuntimeError, match="trial 2 does not fit the free slots"):
        pool.take(trial_id=2)
    pool.give_back(a)
    pool.give_back(b)
    assert pool.free_slots == {"worker-0": (0, 1), "worker-1": (0, 1)}
    # srun starts the same count on every host: 3 slots over 2 hosts cannot be placed
    assert SlotPool(slots_per_trial=3, hosts=hosts, multihost_launcher="srun").placeable(1) == 0


def test_a_trial_wholly_on_this_machine_gets_its_slot_ids_as_gpus():
    pool = SlotPool(slots_per_trial=2, gpus=(0, 1, 2, 3), hosts=(Host("localhost", 4),))
    held = pool.take(trial_id=0)
    assert held.gpus == (0, 1) and held.placement == {"localhost": (0, 1)} and held.via is None


def test_device_ids_follow_an_inherited_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_ids((0, 2)) == {0: "0", 2: "2"} and device_ids(None) == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert device_ids((1,)) == {1: "5"}
    with pytest.raises(ValueError, match="makes only 2 GPU"):
        device_ids((2,))
