"""What toolkit.init_distributed() reads under a real launcher (srun, mpirun), beside the launcher's own
variables: writes OUT_DIR/rank<N>.json. Usage: ``srun --ntasks 2 python cluster_ctx.py OUT_DIR``.
CLUSTER_CTX_TIMEOUT_S bounds the rendezvous (default: init_distributed's)."""
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import toolkit

out = Path(sys.argv[-1])
timeout_s = os.environ.get("CLUSTER_CTX_TIMEOUT_S")
if timeout_s:
    ctx = toolkit.init_distributed(timeout=timedelta(seconds=float(timeout_s)))
else:
    ctx = toolkit.init_distributed()
record = {
    "rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
    "local_world_size": ctx.local_world_size, "node_rank": ctx.node_rank, "num_nodes": ctx.num_nodes,
    "launcher": ctx.launcher, "is_chief": ctx.is_chief,
    "all_gathered": ctx.all_gather_object(ctx.rank),
    "sum": ctx.all_reduce([1.0], op="sum"),
    "env": {k: v for k, v in os.environ.items()
            if k.startswith(("SLURM", "OMPI_COMM_WORLD", "PMIX_RANK"))
            or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
    "pid": os.getpid(),
}
(out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
