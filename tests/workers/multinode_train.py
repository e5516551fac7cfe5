"""A training loop on 2 "nodes" for tests/test_multinode.py: one DeepSpeed engine (ZeRO 1), resume,
preemption, checkpoints on a directory both nodes share.

    torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d ... multinode_train.py OUT CKPT --max-steps N

Writes OUT/ctx<rank>.json (what init_distributed reported, the launcher's node variables, pid,
what the context's collectives returned) and OUT/chief_first.txt (ranks in the order they passed
``ctx.chief_first()``) at start, OUT/progress<rank> after every step and OUT/result<rank>.json at
the end (the step it started from, where it stopped, whether it was preempted). Saves a checkpoint
when it stops.
"""
import argparse
import json
import os
import time
from pathlib import Path

import deepspeed
import torch
from ckpt_common import ds_config, make_layers, train_step

import toolkit


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("ckpt", type=Path)
parser.add_argument("--max-steps", type=int, default=10_000)
parser.add_argument("--sleep", type=float, default=0.02)
args = parser.parse_args()

ctx = toolkit.init_distributed()
with ctx.chief_first():  # the chief's line first, across the nodes
    with open(args.out / "chief_first.txt", "a") as fh:
        fh.write(f"{ctx.rank}\n")
write(args.out / f"ctx{ctx.rank}.json", json.dumps({
    "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
    "local_world_size": ctx.local_world_size, "node_rank": ctx.node_rank, "num_nodes": ctx.num_nodes,
    "launcher": ctx.launcher, "is_local_chief": ctx.is_local_chief, "is_chief": ctx.is_chief,
    "pid": os.getpid(),
    # The context's collectives across the two nodes:
    "broadcast": ctx.broadcast_object({"from": ctx.rank, "payload": [1, 2]} if ctx.is_chief else None),
    "gathered": ctx.gather_object(ctx.rank * 10), "all_gathered": ctx.all_gather_object(ctx.rank),
    "mean": ctx.all_reduce([ctx.rank, 1.0], op="mean"), "max": ctx.all_reduce([ctx.rank], op="max"),
    "env": {k: os.environ.get(k)
            for k in ("GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_RANK")}}))
torch.manual_seed(0)
model = torch.nn.Sequential(*make_layers())
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  config=ds_config(1))
resumed = toolkit.load_checkpoint(engine, args.ckpt)
start = resumed[0] if resumed else 0
step, preempted = start, False
with toolkit.watch_preemption(ctx, check_every=1) as preemption:
    while step < args.max_steps:
        train_step(engine)
        step += 1
        write(args.out / f"progress{ctx.rank}", str(step))
        if preemption.should_preempt():
            preempted = True
            break
        time.sleep(args.sleep)
toolkit.save_checkpoint(engine, args.ckpt, steps_completed=step)
write(args.out / f"result{ctx.rank}.json", json.dumps({
    "start": start, "stopped_at": step, "preempted": preempted, "steps": ctx.all_gather_object(step)}))
