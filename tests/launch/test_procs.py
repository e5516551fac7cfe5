"""toolkit.launch.procs: which processes belong to a job (by the mark in their environment, or below its
launcher), the clean-up that leaves none behind, and a job run to completion with its logs. Pure on
process tables, then real processes: a launcher that leaves an orphan in a session of its own, one that
ignores SIGTERM past its timeout."""

import os
import signal
import socket
import subprocess
import sys
import time

from toolkit.launch.procs import (
    block_interrupts,
    find_trial_processes,
    free_port,
    is_rank_process,
    rss_bytes,
    run_to_completion,
    unblock_interrupts,
)
from toolkit.runtime.trial_env import RUN_ENV, TRIAL_ENV


def test_rss_bytes_reads_this_process_and_is_0_for_one_that_ended():
    assert rss_bytes(os.getpid()) > 0
    assert rss_bytes(os.getpid(), field="VmHWM") >= rss_bytes(os.getpid())
    ended = subprocess.Popen(["true"])
    ended.wait(timeout=30)          # reaped: /proc/<pid> is gone
    assert rss_bytes(ended.pid) == 0 and rss_bytes(ended.pid, field="VmHWM") == 0


def test_a_jobs_processes_are_its_marked_ones_and_its_launchers_descendants():
    mark = f"{TRIAL_ENV}=/out/trials/trial_1/trial.json".encode()
    table = {
        10: (1, b"PATH=/bin\0" + mark + b"\0"),             # marked (a rank in a session of its own)
        11: (1, mark + b"x\0"),                              # another trial's longer name: not this one
        20: (1, b"PATH=/bin\0"),                             # the launcher, not marked
        21: (20, b"LOCAL_RANK=0\0"), 22: (21, b""),          # its descendants
        30: (1, b""),
        os.getpid(): (1, mark + b"\0"),                      # the caller itself is never a target
    }
    assert find_trial_processes("/out/trials/trial_1/trial.json", table=table) == {10}
    assert find_trial_processes("/out/trials/trial_1/trial.json", root=20, table=table) == {10, 20, 21, 22}
    assert find_trial_processes("/out/trials/", prefix=True, table=table) == {10, 11}
    assert find_trial_processes("/out/trials/trial_1/trial.json", root=99, table=table) == {10}  # reaped
    assert is_rank_process(b"A=1\0LOCAL_RANK=3\0") and not is_rank_process(b"XLOCAL_RANK=3\0")


ORPHAN = """import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print("launched", os.environ.get("TOOLKIT_OUTPUT_DIR"), flush=True)
sys.exit(3)
"""
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
           "time.sleep(60)"


def test_a_job_is_run_to_its_end_and_nothing_it_started_survives(tmp_path):
    logs = tmp_path / "logs"
    code = run_to_completion([sys.executable, "-c", ORPHAN], cwd=tmp_path, log_dir=logs, timeout_s=60,
                             grace_s=1.0)
    assert code == 3  # the launcher's status, though its orphan lived on in a session of its own
    assert (logs / "stdout.log").read_text() == f"launched {(logs / 'output').resolve()}\n"
    assert find_trial_processes(str(logs.resolve()), variable=RUN_ENV) == set()  # the orphan was killed
    start = time.monotonic()
    code = run_to_completion([sys.executable, "-c", STUBBORN], cwd=tmp_path, log_dir=tmp_path / "slow",
                             timeout_s=1.0, grace_s=0.5)
    assert code == 124 and time.monotonic() - start < 30  # past its timeout: SIGTERM ignored, SIGKILL
    assert find_trial_processes(str((tmp_path / "slow").resolve()), variable=RUN_ENV) == set()


def test_a_free_port_binds_and_interrupts_wait_for_the_clean_up():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
    previous = block_interrupts()
    try:
        assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        unblock_interrupts(previous)
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
