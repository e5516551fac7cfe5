"""toolkit.launch.procs: the pure and /proc-reading parts (spawning is tested by the runner's and
toolkit.run's tests, with real processes)."""

import os
import subprocess

from toolkit.launch.procs import rss_bytes


def test_rss_bytes_reads_this_process_and_is_0_for_one_that_ended():
    assert rss_bytes(os.getpid()) > 0
    assert rss_bytes(os.getpid(), field="VmHWM") >= rss_bytes(os.getpid())
    ended = subprocess.Popen(["true"])
    ended.wait(timeout=30)          # reaped: /proc/<pid> is gone
    assert rss_bytes(ended.pid) == 0 and rss_bytes(ended.pid, field="VmHWM") == 0
