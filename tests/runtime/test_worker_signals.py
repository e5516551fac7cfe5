"""DataLoader workers protected by toolkit.runtime.worker_signals: they ignore the stop signals,
and never outlive their rank (a plain python process here, no torch.distributed)."""

import os
import signal
import subprocess
import sys
import time

from helpers import procutil

ORPHAN = """
import os, signal, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
from toolkit.runtime.worker_signals import protect_dataloader_workers

class Slow(Dataset):
    # A fetch that takes long (slow storage): torch's own watchdog looks at the parent only
    # between two fetches, so without more an orphaned worker lives until the fetch ends.
    def __len__(self):
        return 4
    def __getitem__(self, i):
        time.sleep(120)
        return torch.zeros(1)

protect_dataloader_workers()
loader = DataLoader(Slow(), batch_size=1, num_workers=2)
it = iter(loader)
time.sleep(1.0)
pids = [w.pid for w in it._workers]
os.kill(pids[0], signal.SIGTERM)  # ignored
time.sleep(0.5)
with open(f"/proc/{pids[0]}/stat") as f:
    state = f.read().rsplit(")", 1)[1].split()[0]
sys.stdout.write(" ".join(map(str, pids)) + f" {state}\\n")
sys.stdout.flush()
os.kill(os.getpid(), signal.SIGKILL)  # the rank dies without running any exit hook
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for init to reap it is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_protected_workers_ignore_sigterm_and_die_with_their_rank(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    proc = subprocess.Popen([sys.executable, str(script)], env=procutil.child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()[-4000:]
        *pids, state = line.split()
        pids = [int(pid) for pid in pids]
        assert len(pids) == 2, (line, proc.stderr.read()[-4000:])
        assert state != "Z", "the worker died of the SIGTERM it should ignore"
        deadline = time.monotonic() + 3  # torch's watchdog alone: not before the 120 s fetch ends
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), "a DataLoader worker outlived its rank"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
