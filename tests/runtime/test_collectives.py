"""BoundedGroup's bookkeeping, in this process with a fake store and fake work objects: the
fast path touches no store; a slow wait records the rank's arrival; a failure names the ranks
whose recorded count is behind. (The real misuse, with 2 ranks under torchrun, is tested in
tests/runtime/test_context.py.)"""

import threading
import time

import pytest

from toolkit.runtime.collectives import BoundedGroup, CollectiveTimeoutError


class Store:
    def __init__(self, data=None):
        self.data = dict(data or {})
        self.sets = 0
        self.lock = threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.sets += 1
            self.data[key] = value.encode()

    def check(self, keys):
        return all(key in self.data for key in keys)

    def get(self, key):
        return self.data[key]


class Work:
    def __init__(self, seconds=0.0, error=None):
        self.end, self.error = time.monotonic() + seconds, error

    def is_completed(self):
        return time.monotonic() >= self.end

    def wait(self):
        time.sleep(max(0.0, self.end - time.monotonic()))
        if self.error:
            raise RuntimeError(self.error)
        return True


def _group(store, rank=0, world_size=2, timeout_s=0.8):
    return BoundedGroup(rank=rank, world_size=world_size, timeout_s=timeout_s, group="g", store=store,
                        prefix="t")


def test_collectives_that_complete_at_once_write_nothing():
    store = Store()
    group = _group(store)
    assert group.record_after_s == pytest.approx(0.1)
    for _ in range(50):
        assert group.run("fast.run", lambda g: g) == "g"
        number = group.arrive("fast.async")
        group.wait("fast.async", number, Work())
    time.sleep(0.3)  # past every deadline: the recorder thread had nothing left to write
    assert store.sets == 0 and group.arrive("x") == 101


def test_a_slow_wait_records_the_arrival_while_waiting():
    store = Store()
    group = _group(store)
    group.run("slow.run", lambda g: time.sleep(0.4))
    assert store.data == {"t/0": b"1 slow.run"}
    number = group.arrive("slow.async")
    group.wait("slow.async", number, Work(0.4))
    assert store.data == {"t/0": b"2 slow.async"} and store.sets == 2


def test_failure_names_the_ranks_behind_and_the_call():
    store = Store({"t/1": b"3 ctx.barrier", "t/2": b"9 ctx.all_reduce"})
    group = _group(store, world_size=4)
    for _ in range(4):
        group.arrive("ctx.barrier")
    number = group.arrive("metrics.report")
    with pytest.raises(CollectiveTimeoutError) as info:
        group.wait("metrics.report", number, Work(0.0, error="Timed out"))
    err = info.value
    assert err.call == "metrics.report" and err.missing == [1, 3]
    assert "metrics.report (toolkit collective #5) did not complete within 0.8 s on rank 0: " \
           "rank(s) [1, 3] never reached it (rank 2 is at #9 (ctx.all_reduce))" in str(err)
    assert store.data["t/0"] == b"5 metrics.report"  # the failing rank recorded itself


def test_world_of_one_has_no_store_and_no_thread():
    group = BoundedGroup(rank=0, world_size=1, timeout_s=60)
    before = threading.active_count()
    assert group.run("solo", lambda g: 7) == 7
    assert threading.active_count() == before


def test_without_a_default_group_torch_gives_no_store_and_none_is_taken():
    """torch raises for the default store before init_process_group: the group then has none
    (what BoundedGroup does without a store: test_failure_without_a_usable_store_...)."""
    import torch.distributed as dist

    from toolkit.runtime import collectives

    assert not dist.is_initialized()
    with pytest.raises((RuntimeError, ValueError)):
        dist.distributed_c10d._get_default_store()
    assert collectives._default_store() is None


class BrokenStore(Store):
    """A store whose server is gone (what a dead launcher leaves): every call raises as torch's does."""

    def set(self, key, value):
        raise RuntimeError("Connection reset by peer")

    def check(self, keys):
        raise RuntimeError("Connection reset by peer")


def _failing(group, call):
    with pytest.raises(CollectiveTimeoutError) as info:
        group.run(call, lambda g: (_ for _ in ()).throw(RuntimeError("Timed out waiting")))
    return info.value


def test_failure_when_every_rank_reached_the_call_blames_one_that_failed_inside_it():
    store = Store({"t/1": b"1 ctx.barrier"})
    err = _failing(_group(store), "ctx.barrier")
    assert err.missing == []
    assert "ctx.barrier (toolkit collective #1) did not complete within 0.8 s on rank 0: every rank " \
           "reached it, so a rank failed or left inside it. It must be called on all ranks" in str(err)
    assert str(err).endswith("Cause: Timed out waiting")


@pytest.mark.parametrize("store", [None, BrokenStore()], ids=["no store", "store gone"])
def test_failure_without_a_usable_store_says_the_ranks_cannot_be_told(store):
    group = _group(store)
    group.record()  # never raises: the store is a diagnosis aid only
    err = _failing(group, "ctx.all_gather_object")
    assert err.missing == []
    assert "on rank 0: the ranks that did not reach it cannot be told. It must be called" in str(err)
