"""toolkit.runtime.ds_shm: DeepSpeed's CPU shared-memory all-reduce segments do not pile up in /dev/shm.

The end-to-end tests run real DeepSpeed ranks under the deepspeed launcher (which sets
LOCAL_SIZE, the condition under which DeepSpeed makes the segments) and look at /dev/shm itself.
"""

import json
import mmap
import os
import subprocess
import sys
import time

import pytest

from helpers import procutil
from toolkit.runtime.ds_shm import SHM_DIR, buffer_name, remove_buffers, remove_stale_buffers, unlink_buffer

WORKER = procutil.WORKERS / "shm_worker.py"


def _segments(port) -> list[str]:
    return sorted(path.name for path in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


@pytest.fixture
def ports():
    """Rendezvous ports a test used; whatever it leaves there, even on failure, is removed after."""
    used: list[int] = []
    yield used
    for port in used:
        remove_buffers(addr="127.0.0.1", port=port)


def _run(tmp_path, mode, ports):
    port = procutil.free_port()
    ports.append(port)
    result = procutil.run(procutil.deepspeed_argv(WORKER, mode, str(tmp_path), port=port),
                          env=procutil.child_env(LOCAL_SIZE="2"))
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    return port, result, records


# -- names and removal (pure file work) ------------------------------------------------------

def test_the_name_is_deepspeeds():
    # shm.cpp: "%s_%d_%s_%s" % (SHM_BUFFER_NAME, getuid(), MASTER_ADDR, MASTER_PORT), then "_<rank>"
    assert buffer_name(addr="127.0.0.1", port=29500, rank=3, uid=7) == \
        "deepspeed_allreduce_buffer_7_127.0.0.1_29500_3"


def test_unlink_buffer_reads_the_rendezvous_from_the_environment(tmp_path):
    name = buffer_name(addr="10.0.0.5", port=4242, rank=1)
    (tmp_path / name).write_bytes(b"x")
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "4242"}
    assert unlink_buffer(0, environ=env, shm_dir=tmp_path) is False
    assert unlink_buffer(1, environ=env, shm_dir=tmp_path) is True
    assert not (tmp_path / name).exists()


def test_remove_buffers_takes_one_rendezvous_only(tmp_path):
    mine = [buffer_name(addr="127.0.0.1", port=2950, rank=r) for r in (0, 1, 12)]
    others = [buffer_name(addr="127.0.0.1", port=29501, rank=0),     # another port with the same prefix
              buffer_name(addr="127.0.0.1", port=2950, rank=0, uid=os.getuid() + 1),  # another user
              buffer_name(addr="127.0.0.1", port=2950, rank=0) + "_x"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_buffers(addr="127.0.0.1", port=2950, shm_dir=tmp_path)
    assert sorted(path.name for path in removed) == sorted(mine)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(others)


def test_stale_means_old_and_mapped_by_no_process(tmp_path):
    old = time.time() - 3600
    names = {kind: buffer_name(addr="127.0.0.1", port=port, rank=0)
             for kind, port in (("stale", 1), ("mapped", 2), ("young", 3))}
    other_user = buffer_name(addr="127.0.0.1", port=4, rank=0, uid=os.getuid() + 1)
    for kind, name in [*names.items(), ("other", other_user)]:
        (tmp_path / name).write_bytes(b"\0" * mmap.PAGESIZE)
        if kind != "young":
            os.utime(tmp_path / name, (old, old))
    # A live process (not this one) maps one of them, as a rank maps its own segment.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, time\n"
        f"f = open({str(tmp_path / names['mapped'])!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0)\n"
        "print('mapped', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "mapped"
        removed = remove_stale_buffers(shm_dir=tmp_path)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert [path.name for path in removed] == [names["stale"]]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [names["mapped"], names["young"], other_user])
    # Once its process is gone the mapped one is stale too.
    assert [path.name for path in remove_stale_buffers(shm_dir=tmp_path)] == [names["mapped"]]


def test_setup_runs_the_module_by_path_and_it_clears_a_stale_segment_of_this_user():
    """scripts/setup.sh's call, on the real /dev/shm: a segment no process maps, an hour old, goes (its
    port is a name no run uses, so no other run's segment is made or named here)."""
    stale = SHM_DIR / buffer_name(addr="127.0.0.1", port=f"toolkit-test-{os.getpid()}", rank=0)
    stale.write_bytes(b"\0" * mmap.PAGESIZE)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    argv = [sys.executable, "-P", str(procutil.REPO / "toolkit" / "runtime" / "ds_shm.py")]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=procutil.child_env())
        assert done.returncode == 0, done.stderr
        assert not stale.exists()
        assert done.stdout.startswith("setup: removed ") and f"segment(s) from {SHM_DIR} that earlier runs " \
            "left and no process maps" in done.stdout
    finally:
        stale.unlink(missing_ok=True)


# -- real DeepSpeed ranks ---------------------------------------------------------------------

def test_deepspeed_alone_leaves_its_segments_behind(tmp_path, ports):
    """The defect being worked around (DeepSpeed 0.19), and remove_buffers on real segments."""
    port, result, records = _run(tmp_path, "deepspeed", ports)
    procutil.check(result)
    assert _segments(port) == [buffer_name(addr="127.0.0.1", port=port, rank=r) for r in (0, 1)]
    assert records[0]["sum"] == [3.0] * 8
    removed = remove_buffers(addr="127.0.0.1", port=port)
    assert len(removed) == 2 and _segments(port) == []


def test_init_distributed_unlinks_the_names_and_even_sigkilled_ranks_leave_nothing(tmp_path, ports):
    port, result, records = _run(tmp_path, "kill", ports)  # every rank SIGKILLs itself at the end
    assert result.returncode != 0, result.stdout[-3000:]
    for record in records:
        # DeepSpeed did make and map both segments (so a leak would show), and their names are gone.
        assert record["maps"] == [f"{SHM_DIR / buffer_name(addr='127.0.0.1', port=port, rank=r)} (deleted)"
                                  for r in (0, 1)], record
        assert record["sum"] == [3.0] * 8  # 1 + 2 on every element, through the segments
    assert _segments(port) == []


@pytest.mark.parametrize("behaviour", ["ok", "hang"])
def test_the_dsat_runner_removes_what_a_trial_left(tmp_path, monkeypatch, ports, behaviour):
    from toolkit.dsat.contract import TrialStatus
    from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
    from toolkit.dsat.search.types import TrialSpec

    procutil.clean_launch_env(monkeypatch)
    # The hanging trial ends by its timeout, long enough for torchrun and both ranks to start on a
    # loaded 2-core machine (4 s was not, in a suite run beside a benchmark); the other has time.
    settings = RunnerSettings(entrypoint=("python3", "dsat_fake_trial.py"), model_dir=procutil.WORKERS,
                              slots_per_trial=2, max_slots=2, max_concurrent=1, grace_s=1.0, poll_s=0.1,
                              timeout_s=120.0 if behaviour == "ok" else 15.0)
    out = tmp_path / "out"
    with TrialRunner(settings, output_dir=out) as runner:
        runner.start(TrialSpec(1, 1, {"stage": 1}, line=0), ds_config={},
                     hparams={"behaviour": behaviour, "shm": True})
        trial_dir = out / "trials" / "trial_1"
        end = time.monotonic() + 60
        while not all((trial_dir / f"rank{r}.json").exists() for r in (0, 1)) and time.monotonic() < end:
            time.sleep(0.05)
        port = json.loads((trial_dir / "rank0.json").read_text())["env"]["MASTER_PORT"]
        ports.append(int(port))
        assert len(_segments(port)) == 2  # the trial made them
        (result,) = runner.wait(timeout=60)
    assert result.status is (TrialStatus.OK if behaviour == "ok" else TrialStatus.TIMEOUT), result.error
    assert _segments(port) == []
