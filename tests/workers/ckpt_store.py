"""A training loop that checkpoints to bucket URLs, stops on SIGTERM and resumes from the buckets.

    torchrun --nproc_per_node 2 ckpt_store.py OUT_DIR --ckpt zero1=s3://b/z1 [--ckpt zero3=gs://b/z3]
        [--steps N] [--sleep S] [--save-every N] [--keep-last K] [--reference]
    python ckpt_store.py OUT_DIR --ckpt zero0=s3://b/p ...            (one process)

One engine per ``--ckpt CASE=URL`` (cases of ckpt_common), trained in lockstep: each loads the
latest checkpoint from its URL (a fresh start when there is none), then trains to --steps under
toolkit.watch_preemption, saving every --save-every steps and when a stop is agreed (then the
loop ends). OUT_DIR/progress<rank> has the steps done, OUT_DIR/run<rank>.json the step each
run started at, its losses and how the loop ended (or the error of the load). --reference: after
a finished loop, fresh engines in the same process train every step from scratch without
checkpoints, in the same lockstep; their losses go to the same file.
"""
import argparse
import json
import logging
import os
import time
from pathlib import Path

import ckpt_common as c

import toolkit

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--ckpt", action="append", required=True, help="CASE=URL")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--save-every", type=int, default=0)
parser.add_argument("--keep-last", type=int, default=None)
parser.add_argument("--reference", action="store_true")
args = parser.parse_args()

logging.basicConfig(level=logging.INFO)
ctx = toolkit.init_distributed()
args.out.mkdir(parents=True, exist_ok=True)
runs = dict(item.split("=", 1) for item in args.ckpt)
result = {"pid": os.getpid(), "start": {}, "losses": {case: {} for case in runs}, "ended": "loading"}
out_file = args.out / f"run{ctx.rank}.json"


def write() -> None:
    tmp = out_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out_file)


def save_all(step):
    for case, url in runs.items():
        toolkit.save_checkpoint(engines[case], url, steps_completed=step, keep_last=args.keep_last)


engines = {case: c.build(case) for case in runs}
try:
    for case, url in runs.items():
        loaded = toolkit.load_checkpoint(engines[case], url)
        result["start"][case] = loaded[0] if loaded else 0
except Exception as err:
    result["load_error"] = f"{type(err).__name__}: {err}"
    write()
    raise
step = min(result["start"].values())
assert len(set(result["start"].values())) == 1, result["start"]
result["ended"] = "running"
write()
with toolkit.watch_preemption(ctx, check_every=1) as preemption:
    while step < args.steps:
        for case in runs:
            result["losses"][case][str(step + 1)] = c.train_step(engines[case])
        step += 1
        (args.out / f"progress{ctx.rank}").write_text(str(step))
        write()
        time.sleep(args.sleep)
        if preemption.should_preempt():
            save_all(step)
            result["ended"] = f"preempted at {step}"
            break
        if args.save_every and step % args.save_every == 0:
            result["saving"] = step
            write()
            save_all(step)
            result["saved"] = step
    else:
        result["ended"] = "finished"
write()
if args.reference and result["ended"] == "finished":
    fresh = {case: c.build(case) for case in runs}  # built, then trained in lockstep, as above
    result["reference"] = {case: {} for case in runs}
    for i in range(args.steps):
        for case in runs:
            result["reference"][case][str(i + 1)] = c.train_step(fresh[case])
    write()
