"""DeepSpeed's CPU shared-memory all-reduce segments under each way of starting the communication.

    LOCAL_SIZE=2 deepspeed --num_gpus 2 shm_worker.py MODE OUT_DIR

MODE:
    deepspeed  deepspeed.init_distributed() alone (what DeepSpeed leaves behind by itself)
    kill       toolkit.init_distributed(), then every rank kills itself with SIGKILL at the end

In both, an all-reduce goes through DeepSpeed's shared-memory segments.

Every rank writes OUT_DIR/rank<R>.json: the /dev/shm segments this process maps (from
/proc/self/maps, " (deleted)" when their name is gone) and the all-reduce's result.
"""
import json
import os
import signal
import sys
from pathlib import Path

import torch

mode, out = sys.argv[-2], Path(sys.argv[-1])  # the deepspeed launcher puts --local_rank=N first
if mode not in ("deepspeed", "kill"):
    raise SystemExit(f"unknown mode {mode!r}")
if mode == "deepspeed":
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
else:
    import toolkit
    rank = toolkit.init_distributed().rank

import deepspeed.comm as ds_comm  # noqa: E402  (after the launcher's variables are read)

total = torch.tensor([float(rank + 1)] * 8)
ds_comm.inference_all_reduce(total)  # on CPU, through the shared-memory segments
maps = [line.split(None, 5)[5] for line in Path("/proc/self/maps").read_text().splitlines()
        if "deepspeed_allreduce_buffer" in line]
(out / f"rank{rank}.json").write_text(json.dumps({"maps": sorted(set(maps)), "sum": total.tolist(),
                                                   "port": os.environ["MASTER_PORT"]}))
torch.distributed.barrier()
if mode == "kill":  # no exit hook, no atexit: only what was done at init time can help
    os.kill(os.getpid(), signal.SIGKILL)
