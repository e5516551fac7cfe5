"""A dsat trial for the real-Slurm tests: started by ``srun`` on each task, rank from SLURM_PROCID.

Copied into a model directory as ``model.py`` beside dsat_sim_result.py (procutil.install_sim_model).
Every task writes ``rank<SLURM_PROCID>.json`` (pid and launcher variables) into the trial directory.
Hyperparameter ``profile``: ``init`` makes the profiling trial call toolkit.init_distributed() (the
rendezvous on the MASTER_ADDR/PORT that dsat's srun line exports) and record what it saw;
``hang`` makes it hang (killed at the trial timeout). Otherwise rank 0 writes a simulated result.
"""
import json
import os
import sys
import time
from pathlib import Path

from dsat_sim_result import simulated_result, write_result  # copied beside this file

hparams = json.loads(Path(os.environ["TOOLKIT_TRIAL_HPARAMS"]).read_text())
ds_config = json.loads(Path(hparams["deepspeed_config"]).read_text())
contract = json.loads(Path(os.environ["TOOLKIT_DSAT_TRIAL"]).read_text())
trial_dir = Path(contract["result_path"]).parent
rank = int(os.environ["SLURM_PROCID"])
behaviour = hparams.get("profile", "ok") if contract["profile"] else "ok"
record = {"pid": os.getpid(), "env": {k: v for k, v in os.environ.items()
                                      if k.startswith("SLURM_") or k in ("MASTER_ADDR", "MASTER_PORT")}}
if behaviour == "init":
    import toolkit

    ctx = toolkit.init_distributed()
    record["ctx"] = {"rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
                     "launcher": ctx.launcher, "all_gathered": ctx.all_gather_object(ctx.rank)}
(trial_dir / f"rank{rank}.json").write_text(json.dumps(record))
if behaviour == "hang":
    time.sleep(3600)
if rank == 0:
    write_result(contract, simulated_result(contract, ds_config))
sys.exit(0)
