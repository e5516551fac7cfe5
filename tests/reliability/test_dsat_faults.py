"""dsat fault injection: a real search (``python -m toolkit.dsat random``) whose trials fail in every way.

Trials (tests/reliability/workers/dsat_fault_model.py, plain Python under torchrun) crash, exceed
the memory budget, hang past the timeout (leaving a grandchild in a session of its own), exit 0
without a result, write a corrupt result, or are SIGKILLed; the autotuner itself is SIGKILLed
mid-search (its trials left running) and restarted with ``--resume``. Every time:

* the search finishes (exit 0) with one row per trial and each faulty trial's expected status;
* no trial that had finished before the kill is started again (its ``starts.log`` has one line);
* no process of any trial is left: none carries a trial's mark, and no live process belongs to
  a process group or session any trial process had (each wrote its pid, pgid and sid).

Short run: one search. Full run: three searches, the autotuner killed at a different point each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from helpers import procutil

FULL = os.environ.get("TOOLKIT_RELIABILITY_FULL") == "1"  # set by scripts/reliability.py
CATEGORY = "dsat fault injection"
MODEL = Path(__file__).resolve().parent / "workers" / "dsat_fault_model.py"
FAULTS = {"1": "crash", "2": "memory", "3": "hang", "4": "no_result", "5": "corrupt", "6": "sigkill"}
EXPECTED = {"crash": "failed", "memory": "oom", "hang": "timeout", "no_result": "failed", "corrupt": "failed",
            "sigkill": "failed"}
MAX_TRIALS = 7  # trial 0 and the 6 faults (1..6): one healthy trial is enough to check


def _model_dir(base: Path) -> Path:
    model_dir = base / "model"
    model_dir.mkdir(parents=True)
    procutil.install_sim_model(MODEL, model_dir)
    (model_dir / "ds_config.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}))
    config = {"name": "faults", "entrypoint": "python3 model.py", "resources": {"slots_per_trial": 1},
              "searcher": {"max_length": 10},
              "hyperparameters": {"deepspeed_config": "ds_config.json", "faults": FAULTS, "sleep_s": 0.3}}
    (model_dir / "deepspeed.yaml").write_text(yaml.safe_dump(config))
    return model_dir


def _results(out: Path) -> set[int]:
    try:
        lines = (out / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return set()
    return {json.loads(line)["trial_id"] for line in lines if '"event": "result"' in line}


def _live() -> dict[int, tuple[int, int, bytes]]:
    """pid -> (pgid, sid, environ) of every live process we can read."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
            if fields[0] in (b"Z", b"X"):
                continue
            table[int(name)] = (int(fields[2]), int(fields[3]), Path(f"/proc/{name}/environ").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    return table


def _leftovers(out: Path) -> list[str]:
    groups = set()
    for log in (out / "trials").glob("trial_*/pids.log"):
        for line in log.read_text().splitlines():
            pid, pgid, sid, _ = map(int, line.split())
            groups |= {pgid, sid}
    mark = f"TOOLKIT_DSAT_TRIAL={out.resolve()}".encode()
    found = []
    for pid, (pgid, sid, environ) in _live().items():
        if mark in environ:
            found.append(f"pid {pid} carries a trial mark")
        elif pgid in groups or sid in groups:
            found.append(f"pid {pid} is in process group {pgid} / session {sid} of a trial")
    return found


def _search(base: Path, *, kill_after: int, seed: int) -> dict:
    model_dir = _model_dir(base)
    out = base / "out"
    argv = [sys.executable, "-m", "toolkit.dsat", "random", str(model_dir / "deepspeed.yaml"), str(model_dir),
            "--output-dir", str(out), "--max-trials", str(MAX_TRIALS), "--zero-stages", "1", "2",
            "--trial-timeout", "15", "--memory-per-slot", "150MiB", "--random-seed", str(seed),
            "--confirm", "0"]
    with open(base / "first.log", "w") as log:
        proc = subprocess.Popen(
            argv, env=procutil.child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while len(_results(out)) < kill_after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        finished = _results(out)
        os.kill(proc.pid, signal.SIGKILL)  # the autotuner alone: its running trials become orphans
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    resumed = procutil.run(argv + ["--resume"], timeout=400)
    rows = []
    if (out / "trials.csv").exists():
        import csv
        with open(out / "trials.csv") as fh:
            rows = list(csv.DictReader(fh))
    starts = {int(d.name.split("_")[1]): len((d / "starts.log").read_text().splitlines())
              for d in (out / "trials").glob("trial_*") if (d / "starts.log").exists()}
    return {"code": resumed.returncode, "output": resumed.stdout, "rows": rows, "finished": finished,
            "starts": starts, "leftovers": _leftovers(out), "out": out}


def test_every_fault_and_a_killed_autotuner(tmp_path, tally):
    t = tally(CATEGORY)
    rounds = [(2, 1), (4, 2), (6, 3)] if FULL else [(3, 1)]
    failures = []
    for index, (kill_after, seed) in enumerate(rounds):
        run = _search(tmp_path / f"round{index}", kill_after=kill_after, seed=seed)
        # the search's trials; the user's own config, measured after them (role "own"), is not one
        status = {int(row["trial_id"]): row["status"] for row in run["rows"] if row["role"] != "own"}
        print(
            f"round {index}: killed after {sorted(run['finished'])}; statuses {status}; "
            f"starts {run['starts']}; resumed search exit {run['code']}"
        )
        rerun = sorted(tid for tid in run["finished"] if run["starts"].get(tid, 0) != 1)
        common = []
        if run["code"] != 0:
            common.append(f"the resumed search exited {run['code']}: {run['output'][-1500:]}")
        if sorted(status) != list(range(MAX_TRIALS)):
            common.append(f"trial rows {sorted(status)}, expected 0..{MAX_TRIALS - 1}")
        if run["leftovers"]:
            common.append(f"processes left: {run['leftovers']}")
        for tid, fault in FAULTS.items():
            problems = common + (
                []
                if status.get(int(tid)) == EXPECTED[fault]
                else [f"trial {tid} ({fault}) ended {status.get(int(tid))!r}, expected {EXPECTED[fault]}"]
            )
            t.record(not problems, f"round {index} {fault}: {problems}")
            failures += problems
        ok_ids = [tid for tid in range(MAX_TRIALS) if str(tid) not in FAULTS]
        wrong_ok = [tid for tid in ok_ids if status.get(tid) != "ok"]
        kill_problems = common + ([f"finished trials started again: {rerun}"] if rerun else []) + \
            ([f"healthy trials not ok: {wrong_ok}"] if wrong_ok else []) + \
            ([] if run["finished"] else ["the autotuner was killed before any trial finished"])
        t.record(not kill_problems, f"round {index} autotuner SIGKILL after {len(run['finished'])} results: "
                                    f"{kill_problems}")
        failures += kill_problems
    t.detail = (
        f"{len(FAULTS)} trial faults + 1 autotuner SIGKILL/--resume per search, {len(rounds)} search(es)"
    )
    assert not failures, "\n".join(dict.fromkeys(failures))
