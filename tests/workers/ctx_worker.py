"""Initialise the toolkit context, exercise its collectives, write what it saw to OUT_DIR/rank<N>.json.

With CTX_WORKER_DEEPSPEED_FIRST=1, ``deepspeed.init_distributed`` makes the process group first,
as a DeepSpeed script does, and toolkit adopts it."""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

import toolkit

out = Path(sys.argv[-1])  # the deepspeed launcher puts --local_rank=N first
if os.environ.get("CTX_WORKER_DEEPSPEED_FIRST") == "1":
    import deepspeed

    deepspeed.init_distributed("gloo")
made_before = dist.is_initialized()
ctx = toolkit.init_distributed()
again = toolkit.init_distributed()
record = {
    "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
    "local_world_size": ctx.local_world_size, "node_rank": ctx.node_rank, "num_nodes": ctx.num_nodes,
    "device": str(ctx.device), "is_chief": ctx.is_chief, "backend": ctx.backend, "launcher": ctx.launcher,
    "idempotent": again is ctx, "adopted": made_before,
    "broadcast": ctx.broadcast_object({"from": ctx.rank, "payload": [1, 2]} if ctx.is_chief else None),
    "gathered": ctx.gather_object(ctx.rank * 10),
    "all_gathered": ctx.all_gather_object(ctx.rank),
    "mean": ctx.all_reduce([ctx.rank, 1.0], op="mean"),
    "max": ctx.all_reduce([ctx.rank], op="max"),
}
order: list[int] = []
with ctx.chief_first():
    marker = out / "chief_first.txt"
    with open(marker, "a") as fh:
        fh.write(f"{ctx.rank}\n")
ctx.barrier()
(out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
