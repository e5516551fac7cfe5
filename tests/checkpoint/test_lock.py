"""One writer per checkpoint directory (toolkit/checkpoint/lock.py, issue 41).

The chief's lock with real holders: a live process holding the lock file is waited for and named,
then refused; once it is dead its lock is taken over; a second run's process exits 2. Two runs of
2 real ranks on one directory (the second waits, names the first, then resumes bitwise) are in
tests/test_preemption.py; a lock left by a SIGKILLed run, taken over, in test_api.py's killed runs.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import procutil
from toolkit.checkpoint import lock
from toolkit.checkpoint.stop_record import STOP_FILE
from toolkit.errors import CheckpointLockError
from toolkit.runtime.context import DistributedContext


def _world_of_one() -> DistributedContext:
    return DistributedContext(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                              num_nodes=1, device=torch.device("cpu"), backend="gloo", launcher="none")


# A process of "another run" holding the lock file open, as a live chief does.
HOLDER = """
import sys, time
held = open(sys.argv[1])
print("holding", flush=True)
time.sleep(60)
"""


def test_a_live_holder_is_named_and_refused_a_dead_one_taken_over(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    path = lock.lock_path(root)
    path.parent.mkdir(parents=True)
    info = {"host": os.uname().nodename, "pid": 4242, "command": "python train.py --other",
            "since": time.time()}
    path.write_text(f"{info['host']} 4242\n{json.dumps(info)}\n")
    (root / STOP_FILE).write_text("{}")  # the previous run's record: the new holder removes it
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        monkeypatch.setenv("TOOLKIT_WAIT_FOR_OTHER_RUN_S", "1.5")
        started = time.monotonic()
        with pytest.raises(CheckpointLockError, match=r"held by another run .* pid 4242 \(python train.py "
                                                      rf"--other\).*pid {holder.pid} holds it"):
            lock.hold_directory(_world_of_one(), str(root))
        assert 1.5 <= time.monotonic() - started < 10
        assert (root / STOP_FILE).exists()  # nothing touched
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setenv("TOOLKIT_WAIT_FOR_OTHER_RUN_S", "0")  # a dead holder is taken over without a wait
    try:
        assert lock.hold_directory(_world_of_one(), str(root)) is True
        assert json.loads(path.read_text().splitlines()[1])["pid"] == os.getpid()
        assert not (root / STOP_FILE).exists()
        assert lock.hold_directory(_world_of_one(), str(root)) is False  # held for the process's lifetime
        assert lock.held_directories() == [os.path.realpath(root)]
        path.unlink()  # removed by hand: the next save takes it again
        lock.verify_held(str(root))
        assert json.loads(path.read_text().splitlines()[1])["pid"] == os.getpid()
    finally:
        lock._release_all()
        lock._agreed.discard(os.path.realpath(root))
    assert not path.exists()  # released at exit (the directory keeps the waiters' clean-up guard)


# A second run's chief: the directory is held by the test process itself; uncaught, exit status 2.
SECOND = """
import sys, torch
from toolkit.checkpoint import lock
from toolkit.runtime.context import DistributedContext
ctx = DistributedContext(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                         device=torch.device("cpu"), backend="gloo", launcher="none")
lock.hold_directory(ctx, sys.argv[1])
print("not reached")
"""


def test_a_second_run_exits_2_naming_the_holder(tmp_path):
    root = tmp_path / "ckpt"
    held = lock._try_create(lock.lock_path(root))
    try:
        result = subprocess.run([sys.executable, "-c", SECOND, str(root)], capture_output=True, text=True,
                                timeout=120, env=procutil.child_env(TOOLKIT_WAIT_FOR_OTHER_RUN_S="1"))
    finally:
        os.close(held.fd)
        os.unlink(held.path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "CheckpointLockError" in result.stderr, result.stderr[-3000:]
    assert f"pid {os.getpid()}" in result.stderr, result.stderr[-3000:]  # the holder, named
    assert "not reached" not in result.stdout


def test_holder_text_is_empty_for_a_missing_or_foreign_file(tmp_path):
    path = tmp_path / "writer"
    assert lock.holder_text(path) == ""                      # no file
    path.write_text("host 1\n{not json\n")
    assert lock.holder_text(path) == ""                      # damaged
    path.write_text("host 1\n[1, 2]\n")
    assert lock.holder_text(path) == ""                      # JSON, but not toolkit's record
    path.write_text('h 7\n{"host": "h", "pid": 7, "command": "python t.py"}\n')
    assert lock.holder_text(path) == "host h, pid 7 (python t.py)"


def test_a_lock_directory_that_is_a_symlink_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / lock.LOCK_DIR).symlink_to(elsewhere)
    with pytest.raises(CheckpointLockError,
                       match=r"cannot create the writer lock .*writer: .*is a symlink; remove it"):
        lock.hold_directory(_world_of_one(), str(root))
    assert list(elsewhere.iterdir()) == []                   # nothing written through the link
    assert lock.held_directories() == []


def test_a_holder_on_another_host_cannot_be_seen_and_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    path = lock.lock_path(root)
    path.parent.mkdir(parents=True)
    info = {"host": "node-17.other", "pid": 4242, "command": "python train.py", "since": time.time()}
    path.write_text(f"node-17.other 4242\n{json.dumps(info)}\n")
    monkeypatch.setenv("TOOLKIT_WAIT_FOR_OTHER_RUN_S", "0")
    with pytest.raises(CheckpointLockError, match=r"host node-17.other, pid 4242 .*cannot be seen from here "
                                                  r"\(it was taken on host node-17.other\).*remove .*writer"):
        lock.hold_directory(_world_of_one(), str(root))
    assert json.loads(path.read_text().splitlines()[1])["pid"] == 4242  # left alone


def test_a_lock_replaced_by_another_run_stops_the_save_and_a_child_keeps_the_parents(tmp_path):
    root = tmp_path / "ckpt"
    key = os.path.realpath(root)
    assert lock.hold_directory(_world_of_one(), str(root)) is True
    path = lock.lock_path(root)
    try:
        # A forked child (a DataLoader worker) inherits the table, not the lock: it neither reports nor
        # checks nor releases the parent's lock.
        pid = os.fork()
        if pid == 0:
            ok = lock.held_directories() == [] and lock.verify_held(str(root)) is None
            lock._release_all()
            os._exit(0 if ok and path.exists() else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert json.loads(path.read_text().splitlines()[1])["pid"] == os.getpid()
        lock.verify_held(str(tmp_path / "never-held"))       # not held here: nothing to check
        path.unlink()                                        # another run takes the directory meanwhile
        path.write_text('other 99\n{"host": "other", "pid": 99, "command": "python other.py"}\n')
        with pytest.raises(CheckpointLockError, match=r"replaced by another run's \(host other, pid 99 "
                                                      r"\(python other.py\)\); not writing beside it"):
            lock.verify_held(str(root))
        assert lock.held_directories() == []
        assert json.loads(path.read_text().splitlines()[1])["pid"] == 99  # the other run's lock stays
    finally:
        lock._release_all()
        lock._agreed.discard(key)
