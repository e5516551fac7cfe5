"""A stand-in for a dsat trial, for tests/test_dsat_runner.py. Plain Python (no torch): fast to start.

Started by TrialRunner through torchrun or the deepspeed launcher, as ``python3
dsat_fake_trial.py``; what it does comes from the trial's hyperparameters
(``TOOLKIT_TRIAL_HPARAMS``), key ``behaviour``:

    ok          the chief writes a valid result (with a profile in the profiling trial); exit 0
    sleep       sleep ``sleep_s`` then as ok
    crash       raise an exception (exit status 1)
    no_result   exit 0 without writing anything
    corrupt     the chief writes a truncated JSON file; exit 0
    bad_metric  the chief writes a result that lacks a metric; exit 0
    oom         the chief writes status "oom" (as dsat_reporting_context does on CUDA OOM); exit 75
    memory      allocate and touch ``alloc_mib`` MiB, then hang; with ``free: true`` free them
                first (a peak the resident size no longer shows)
    orphan      start a grandchild in a new session (it sleeps 600 s), then as ok
    hang        hang forever; with ``orphan: true`` start such a grandchild first
    ignore_term ignore SIGTERM and hang
    build       run ``ninja`` (path ``ninja``) in ``fake_op<R>/`` of the trial directory, whose one
                "compiler" touches ``alloc_mib`` MiB for ``hold_s`` s, then as ok
    preempted   the chief writes a stop record to ``TOOLKIT_STOP_RECORD`` (as toolkit does after an
                agreed preemption) and no result; exit 0

Every rank writes ``rank<R>.json`` into the trial directory at start (pid, times, environment
seen), prints one line, and adds ``"end"`` when it leaves normally; grandchild pids go to ``grandchild<R>.pid``.
With ``shm: true`` every rank first leaves a file where DeepSpeed leaves its shared-memory
all-reduce segment (/dev/shm, named from the uid, MASTER_ADDR, MASTER_PORT and RANK).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

contract = json.loads(Path(os.environ["TOOLKIT_DSAT_TRIAL"]).read_text())
hparams = json.loads(Path(os.environ["TOOLKIT_TRIAL_HPARAMS"]).read_text())
trial_dir = Path(contract["result_path"]).parent
rank = int(os.environ.get("RANK", "0"))
behaviour = hparams["behaviour"]

record = {"pid": os.getpid(), "start": time.time(), "cwd": os.getcwd(),
          "hparams": hparams, "argv": sys.argv,
          "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "MASTER_PORT",
                                                 "WORLD_SIZE", "LOCAL_RANK", "TOOLKIT_DSAT_TRIAL",
                                                 "TOOLKIT_TRIAL_HPARAMS", "TOOLKIT_OUTPUT_DIR",
                                                 "MALLOC_MMAP_THRESHOLD_")}}
if hparams.get("shm"):  # before the marker: a test that saw the marker finds the segment
    segment = Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
                                  f"{os.environ['MASTER_PORT']}_{rank}")
    segment.write_bytes(b"\0" * 4096)
marker = trial_dir / f"rank{rank}.json"
marker.write_text(json.dumps(record))
print(f"fake trial {contract['trial_id']} on rank {rank}", flush=True)  # the runner's logs label it


def write_result(payload: dict) -> None:
    tmp = Path(contract["result_path"] + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, contract["result_path"])


def ok_result() -> dict:
    metrics = {"FLOPS_per_gpu": 1.5e9, "throughput": 100.0, "forward": 2.0, "backward": 4.0, "latency": 7.5}
    profile = {"num_params": 676, "trainable_params": 672, "activation_bytes_per_example": 272,
               "memory_per_slot": contract["memory_per_slot"] or 1 << 30, "baseline_bytes": 1 << 20,
               "half_precision": False, "device": "cpu"} if contract["profile"] else None
    return {"trial_id": contract["trial_id"], "status": "ok", "metrics": metrics, "profile": profile}


def grandchild() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    (trial_dir / f"grandchild{rank}.pid").write_text(str(child.pid))


def end_normally() -> None:
    record["end"] = time.time()
    marker.write_text(json.dumps(record))


if behaviour == "sleep":
    time.sleep(float(hparams["sleep_s"]))
    behaviour = "ok"
if behaviour == "orphan":
    grandchild()
    behaviour = "ok"
if behaviour == "build":   # what a rank that JIT-builds an op runs: ninja, and a big compiler below it
    op_dir = trial_dir / f"fake_op{rank}"
    op_dir.mkdir(exist_ok=True)
    (op_dir / "cc.py").write_text(f"import time\nblock = bytearray({int(hparams['alloc_mib'])} << 20)\n"
                                  "for i in range(0, len(block), 4096):\n    block[i] = 1\n"
                                  f"time.sleep({float(hparams['hold_s'])})\nopen('fake_op.so', 'w').close()\n")
    (op_dir / "build.ninja").write_text(f"rule cc\n  command = {sys.executable} cc.py\nbuild fake_op.so: cc cc.py\n")
    subprocess.run([hparams["ninja"]], cwd=op_dir, check=True, timeout=120, stdout=subprocess.DEVNULL)
    behaviour = "ok"

if behaviour == "ok":
    if rank == 0:
        write_result(ok_result())
    end_normally()
elif behaviour == "crash":
    raise RuntimeError(f"boom from the fake trial on rank {rank}")
elif behaviour == "no_result":
    end_normally()
elif behaviour == "preempted":
    if rank == 0:
        Path(os.environ["TOOLKIT_STOP_RECORD"]).write_text(json.dumps({
            "format": 1, "state": "preempted", "resumable": False, "cause": "SIGTERM", "steps_completed": None,
            "tag": None, "checkpoint_dir": None, "run_id": None, "stopped_at": time.time(), "host": "h",
            "pid": os.getpid()}))
    end_normally()
elif behaviour == "corrupt":
    if rank == 0:
        Path(contract["result_path"]).write_text('{"trial_id": 1, "status": "ok", "metr')
    end_normally()
elif behaviour == "bad_metric":
    if rank == 0:
        result = ok_result()
        del result["metrics"]["latency"]
        write_result(result)
    end_normally()
elif behaviour == "oom":
    if rank == 0:
        write_result({"trial_id": contract["trial_id"], "status": "oom", "metrics": {}, "profile": None,
                      "error": "CUDA out of memory (fake)"})
    sys.exit(75)
elif behaviour == "memory":
    block = bytearray(int(hparams["alloc_mib"]) * 1024 * 1024)
    for i in range(0, len(block), 4096):  # touch every page so it counts in RSS
        block[i] = 1
    if hparams.get("free"):
        del block  # an mmap'd block: back to the system at once, VmRSS drops, VmHWM keeps the peak
    time.sleep(600)
elif behaviour == "hang":
    if hparams.get("orphan"):
        grandchild()
    time.sleep(600)
elif behaviour == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
else:
    raise SystemExit(f"unknown behaviour {behaviour!r}")
