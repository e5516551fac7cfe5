"""A DeepSpeed loop with DataLoader workers that a SIGTERM to torchrun must stop cleanly.

    torchrun --nproc_per_node 2 preempt_workers.py OUT_DIR [--max-steps N]

Two loaders, each with 2 worker processes, both started *before* watch_preemption: DeepSpeed's
``training_data=`` loader and a torch DataLoader; every step draws a batch from each, so one run
shows both kinds of workers surviving the signal. Each step sleeps a little; OUT_DIR/progress<rank>
has the steps completed; on should_preempt() the loop saves a checkpoint with
toolkit.save_checkpoint and writes OUT_DIR/stopped<rank>; at max steps it writes
OUT_DIR/finished<rank>; after the loop, OUT_DIR/left<rank>.json has the signal the rank received
and every rank's last step. A rerun resumes from the checkpoint (OUT_DIR/resumed<rank> holds the
step it resumed at).
"""
import argparse
import json
import os
import time
from pathlib import Path

import deepspeed
import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--max-steps", type=int, default=400)
parser.add_argument("--local_rank", type=int, help="added by the deepspeed launcher; unused")
args = parser.parse_args()

ctx = toolkit.init_distributed()
torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 4), torch.randn(512, 2))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # a torch optimizer: no DeepSpeed op to build
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "zero_optimization": {"stage": 0}, "dataloader_drop_last": True}
engine, _, ds_loader, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                               training_data=data)
ds_loader.num_local_io_workers = 2  # DeepSpeed builds its DataLoader at each iter, with these
loaders = (ds_loader, DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True, drop_last=True))
ckpt = args.out / "ckpt"
loaded = toolkit.load_checkpoint(engine, ckpt)
step = loaded[0] if loaded else 0
if loaded:
    (args.out / f"resumed{ctx.rank}").write_text(str(step))
batches = [iter(loader) for loader in loaders]  # the workers start here, before the watcher


def draw(i):
    try:
        return next(batches[i])
    except StopIteration:
        batches[i] = iter(loaders[i])
        return next(batches[i])


with toolkit.watch_preemption(ctx, check_interval=0.2) as preemption:
    while step < args.max_steps:
        (x, y), (x2, y2) = draw(0), draw(1)
        loss = ((engine(x) - y) ** 2).mean() + ((engine(x2) - y2) ** 2).mean()
        engine.backward(loss)
        engine.step()
        time.sleep(0.02)
        step += 1
        (args.out / f"progress{ctx.rank}").write_text(str(step))
        if preemption.should_preempt():
            toolkit.save_checkpoint(engine, ckpt, steps_completed=step)
            (args.out / f"stopped{ctx.rank}").write_text(str(step))
            break
    else:
        (args.out / f"finished{ctx.rank}").write_text(str(step))
# A blocking collective after close: it only completes if the ranks left the loop in step.
final_steps = ctx.all_gather_object(step)
received = preemption.received_signal
(args.out / f"left{ctx.rank}.json").write_text(json.dumps({"received": received and received.name,
                                                          "final_steps": final_steps}))
print(f"rank {ctx.rank} pid {os.getpid()} left the loop at step {step}", flush=True)
