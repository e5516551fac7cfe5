"""A tiny DeepSpeed loop that a scheduler's signal stops through preemption, with a checkpoint.

    srun --ntasks 2 python cluster_train.py OUT_DIR [--max-steps N] [--sleep S] [--block-usr1]

Resumes from OUT_DIR/checkpoints when it holds one. Writes OUT_DIR/start<rank>.json (the context,
the Slurm variables, the step it resumed at) once ``watch_preemption`` is installed: from then on a
signal stops the loop instead of killing the rank. On ``should_preempt()`` every rank saves a
checkpoint (toolkit.save_checkpoint) and writes OUT_DIR/stop<rank>.json; at --max-steps it saves
and writes OUT_DIR/done<rank>.json. Exits 0 either way.

--block-usr1 blocks SIGUSR1 from the interpreter's first line until the watcher is installed, so
that one that comes while the rank starts (Slurm's ``--signal=USR1@N`` arrives at slurmctld's
next 30 s check, whenever that is) waits instead of killing it.
"""
import signal
import sys

if "--block-usr1" in sys.argv:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import deepspeed  # noqa: E402
import torch  # noqa: E402

import toolkit  # noqa: E402


def write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path, nargs="?")
parser.add_argument("--max-steps", type=int, default=100_000)
parser.add_argument("--sleep", type=float, default=0.02)
parser.add_argument("--block-usr1", action="store_true")
args = parser.parse_args()
out = args.out or toolkit.get_output_dir("runs/cluster_train")
out.mkdir(parents=True, exist_ok=True)

ctx = toolkit.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
engine, *_ = deepspeed.initialize(
    model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
    config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": 0}})
ckpt = out / "checkpoints"
loaded = toolkit.load_checkpoint(engine, ckpt)
step = loaded[0] if loaded else 0
resumed_at = step

with toolkit.watch_preemption(ctx, check_interval=0.2) as preemption:
    if args.block_usr1:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    write(out / f"start{ctx.rank}.json", {
        "rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
        "launcher": ctx.launcher, "resumed_at": resumed_at, "pid": os.getpid(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}})
    stopped = False
    while step < args.max_steps:
        x = torch.randn(2, 4)
        loss = (engine(x) ** 2).mean()
        engine.backward(loss)
        engine.step()
        step += 1
        time.sleep(args.sleep)
        if preemption.should_preempt():
            stopped = True
            break
    received = preemption.received_signal
toolkit.save_checkpoint(engine, ckpt, steps_completed=step)
write(out / (f"stop{ctx.rank}.json" if stopped else f"done{ctx.rank}.json"), {
    "rank": ctx.rank, "step": step, "resumed_at": resumed_at,
    "received": received.name if received else None, "steps": ctx.all_gather_object(step)})
