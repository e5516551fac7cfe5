"""A simulated model for dsat fault injection: tests/workers/dsat_model_trial.py plus faults by trial id.

Plain Python (no torch), so trials start fast. Hyperparameters:
    faults     {"<trial id>": fault}; fault is one of
               crash      print to stderr and exit 3
               memory     allocate and touch ``alloc_mib`` MiB (default 400), then hang: over the budget
               hang       start a grandchild in a session of its own, then hang past the trial timeout
               no_result  exit 0 without writing a result
               corrupt    write a truncated result file, exit 0
               sigkill    SIGKILL itself (the rank dies as if the kernel's OOM killer took it)
    sleep_s    seconds every trial sleeps first (so the autotuner can be killed mid-search)
Every start is appended to ``<trial dir>/starts.log``; every process writes its pid, process
group and session to ``<trial dir>/pids.log`` (grandchildren included).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsat_sim_result import simulated_result, write_result  # copied beside this file

hparams = json.loads(Path(os.environ["TOOLKIT_TRIAL_HPARAMS"]).read_text())
ds_config = json.loads(Path(hparams["deepspeed_config"]).read_text())
contract = json.loads(Path(os.environ["TOOLKIT_DSAT_TRIAL"]).read_text())
trial_dir = Path(contract["result_path"]).parent
trial_id = contract["trial_id"]


def note_pid(pid: int) -> None:
    with open(trial_dir / "pids.log", "a") as fh:
        fh.write(f"{pid} {os.getpgid(pid)} {os.getsid(pid)} {os.getppid()}\n")


with open(trial_dir / "starts.log", "a") as fh:
    fh.write(f"{os.environ.get('RANK', '0')} {time.time()}\n")
note_pid(os.getpid())
note_pid(os.getppid())  # the launcher (torchrun)

fault = (hparams.get("faults") or {}).get(str(trial_id), "ok")
time.sleep(float(hparams.get("sleep_s", 0.0)))
if fault == "crash":
    print(f"injected crash in trial {trial_id}", file=sys.stderr)
    sys.exit(3)
if fault == "memory":
    block = bytearray(int(hparams.get("alloc_mib", 400)) * 1024 * 1024)
    for i in range(0, len(block), 4096):  # touch every page so that it counts in RSS
        block[i] = 1
    time.sleep(600)
if fault == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    note_pid(child.pid)
    time.sleep(600)
if fault == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if fault == "no_result":
    sys.exit(0)
if fault == "corrupt":
    Path(contract["result_path"]).write_text('{"trial_id": %d, "status": "ok", "metr' % trial_id)
    sys.exit(0)

write_result(contract, simulated_result(contract, ds_config))
