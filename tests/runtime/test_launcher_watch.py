"""A rank whose launcher is gone stops as if signalled (toolkit.runtime.launcher_watch, issue 41), and
a rank waits for another run that still serves its rendezvous port (toolkit.runtime.rendezvous_wait).

The rule (which ancestors are watched) is a pure function of command lines; "exited" is read from
real processes (a ``sleep`` child: running, a zombie, reaped, a pid reused). The whole path under
real launchers (the deepspeed runner killed alone, torchrun's agent SIGKILLed, a wrapper that exits
while its launcher lives) is in tests/test_preemption.py.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from toolkit.errors import ConfigError, RunConflictError
from toolkit.preemption import last_agreed_stop, watch_preemption
from toolkit.runtime import launcher_watch, rendezvous_wait
from toolkit.runtime.context import DistributedContext
from toolkit.runtime.launcher_watch import (
    LauncherMonitor,
    ProcessInfo,
    ancestors,
    exited,
    launcher_chain,
    launcher_name,
    read_process,
)
from toolkit.runtime.run_conflict import wait_bound

PY = "/venv/bin/python3.11"


@pytest.mark.parametrize("argv, name", [
    ([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "t.py"], "torchrun"),
    ([PY, "/venv/bin/torchrun", "t.py"], "torchrun"),
    (["torchrun", "--standalone", "t.py"], "torchrun"),
    ([PY, "/venv/bin/deepspeed", "t.py"], "deepspeed"),                 # the console script
    ([PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "t.py"], "deepspeed.launcher.launch"),
    ([PY, "-W", "ignore", "-m", "deepspeed.launcher.runner", "t.py"], "deepspeed"),
    (["mpirun", "-np", "2", "python", "t.py"], "mpirun"),
    (["/usr/bin/orted", "-mca", "ess", "env"], "orted"),
    (["slurmstepd: [12.0]"], "slurmstepd"),
    ([PY, "-m", "toolkit.run", "exp.yaml", "."], "toolkit.run"),
    ([PY, "-m", "determined.launch.wrap_rank", "0", "--", "python", "t.py"], "determined.launch.wrap_rank"),
    (["bash", "-c", "torchrun t.py"], None),                            # a shell is never a launcher
    (["setsid", "torchrun", "t.py"], None),
    (["nohup", "deepspeed", "t.py"], None),
    ([PY, "t.py"], None), ([PY, "-c", "import x"], None), ([PY, "-m", "pytest"], None),
    ([PY, "-u"], None), ([PY, "-W", "ignore"], None), ([PY, "-m"], None),   # no script, no module
    ([], None), ([""], None),
])
def test_which_commands_are_launchers(argv, name):
    assert launcher_name(argv) == name


def _p(pid, *argv):
    return ProcessInfo(pid=pid, ppid=pid - 1, start=pid * 10, state="S", argv=tuple(argv))


def test_only_launchers_are_watched_wrappers_and_shells_never():
    # a rank under `bash -c "deepspeed ..."` in a user's shell: the launcher's two processes only
    rank_ancestors = [_p(9, PY, "-u", "-m", "deepspeed.launcher.launch"), _p(8, PY, "/venv/bin/deepspeed"),
                      _p(7, "bash", "-c", "deepspeed t.py"), _p(6, "-bash"), _p(5, "sshd: user@pts/0")]
    assert [p.pid for p in launcher_chain(rank_ancestors)] == [9, 8]
    # a rank reparented by setsid (or a double-forking shell) to init: nothing to watch, never a stop
    assert launcher_chain([]) == () and launcher_chain([_p(3, "setsid", "python", "t.py")]) == ()


def _sleeper() -> tuple[subprocess.Popen, ProcessInfo | None]:
    """A ``sleep 30`` child and what /proc says of it once its exec is complete. Popen returns when exec
    has closed its error pipe, which the kernel does before it lays out the new program's arguments: for
    a moment /proc/PID/cmdline is empty (4 reads in 1500 here, and one CI failure)."""
    child = subprocess.Popen(["sleep", "30"])
    deadline = time.monotonic() + 10
    while not getattr(info := read_process(child.pid), "argv", ()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return child, info


def test_exited_tells_a_running_process_from_a_zombie_a_reaped_one_and_a_reused_pid():
    child, info = _sleeper()
    try:
        assert info is not None and info.ppid == os.getpid() and info.argv == ("sleep", "30")
        assert not exited(info)
        assert exited(ProcessInfo(info.pid, info.ppid, info.start + 1, "S"))  # another start: pid reused
        child.kill()
        deadline = time.monotonic() + 10
        while (read_process(child.pid) or info).state != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert read_process(child.pid).state == "Z" and exited(info)  # exited, not yet reaped
    finally:
        child.kill()
        child.wait()
    assert exited(info) and read_process(child.pid) is None
    assert ancestors()[0].pid == os.getppid()


def _world_of_one() -> DistributedContext:
    return DistributedContext(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                              num_nodes=1, device=torch.device("cpu"), backend="gloo", launcher="none")


def test_the_monitor_reports_an_exit_once_and_a_watcher_stops_as_if_signalled(monkeypatch):
    child, info = _sleeper()
    seen: list[int] = []
    monitor = LauncherMonitor([info], lambda p: seen.append(p.pid), interval_s=0.02).start()
    monkeypatch.setattr("toolkit.preemption.remember_launchers", lambda: (info,))
    try:
        with watch_preemption(_world_of_one()) as watcher:
            assert [watcher.should_preempt() for _ in range(3)] == [False] * 3 and not watcher.launcher_exited
            child.kill()
            child.wait()
            deadline = time.monotonic() + 10
            while not watcher.should_preempt() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert watcher.preempted and watcher.launcher_exited and watcher.received_signal is None
        assert last_agreed_stop().cause == "a launcher exited"
        # This monitor polls on a thread of its own: the watcher's may have seen the exit first.
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [child.pid]
    finally:
        monitor.stop()
        child.kill()
        child.wait()
    assert not any(t.name == "toolkit-launcher-watch" and t.is_alive() for t in threading.enumerate())


def test_the_watch_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(launcher_watch, "_remembered", None)
    monkeypatch.setenv(launcher_watch.WATCH_ENV, "0")
    assert launcher_watch.remember_launchers() == () and launcher_watch.remembered_launchers() == ()


# ---------------------------------------------------------------- the rendezvous port of another run

# A listener of an earlier run, out of this process's family: forked twice, in a session of its own.
LISTENER = """
import os, socket, sys, time
if os.fork():
    os._exit(0)
os.setsid()
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
open(sys.argv[1] + ".tmp", "w").write(f"{os.getpid()} {server.getsockname()[1]}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def test_a_port_served_by_an_earlier_runs_rank_0_is_waited_for_and_named_then_taken(tmp_path):
    assert wait_bound({}) == 300 and wait_bound({"TOOLKIT_WAIT_FOR_OTHER_RUN_S": "2.5"}) == 2.5
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ConfigError, match=f"TOOLKIT_WAIT_FOR_OTHER_RUN_S='{bad}'"):
            wait_bound({"TOOLKIT_WAIT_FOR_OTHER_RUN_S": bad})
    assert not rendezvous_wait.is_local_address("192.0.2.1")  # TEST-NET: not this machine's
    ready = tmp_path / "ready"
    subprocess.run([sys.executable, "-c", LISTENER, str(ready)], check=True, timeout=30)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    pid, port = map(int, ready.read_text().split())
    marker = rendezvous_wait.marker_path(port)
    try:
        # Unmarked (this run's own rank 0 still in its rendezvous, or not toolkit's): no wait
        started = time.monotonic()
        rendezvous_wait.wait_for_rendezvous_port("127.0.0.1", port, bound_s=0)
        assert time.monotonic() - started < 5
        # Marked by a rank 0 whose rendezvous completed: an earlier run, waited for and named
        marker.parent.mkdir(mode=0o700, exist_ok=True)
        marker.write_text(json.dumps({"pid": pid, "start": read_process(pid).start}))
        with pytest.raises(RunConflictError, match=rf"127.0.0.1:{port} .* pid {pid} .*-c"):
            rendezvous_wait.wait_for_rendezvous_port("127.0.0.1", port, bound_s=1.5)
        os.kill(pid, signal.SIGKILL)
        rendezvous_wait.wait_for_rendezvous_port("127.0.0.1", port, bound_s=5)  # gone: returns
        mine = rendezvous_wait.marker_path(1)
        rendezvous_wait.mark_rendezvous(1)  # this process's own; the ended listener's marker goes
        assert json.loads(mine.read_text()) == {"pid": os.getpid(), "start": read_process(os.getpid()).start}
        assert not marker.exists()
        mine.unlink()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        marker.unlink(missing_ok=True)
