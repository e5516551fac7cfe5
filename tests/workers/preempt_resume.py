"""A DeepSpeed-Chat-style resume client (its step-1 loop, ported): stopped anywhere, run again, exact.

    deepspeed --num_gpus 2 preempt_resume.py OUT [--steps N] [--sleep S] [--hold-save GATE]
    torchrun --nproc_per_node 2 preempt_resume.py OUT ...          (CPU: LOCAL_SIZE=2 for deepspeed)

A tiny causal LM with dropout, ZeRO 2 with DeepSpeed's Adam (its CPU kernel) and a warmup
schedule, gradient accumulation 2, a ResumableDistributedSampler fed through micro_batches, and
DeepSpeed-Chat's own uses of ``len(train_dataloader)`` (the schedule length, epochs, step labels).
It loads OUT/ckpt, trains to --steps under watch_preemption and saves when every rank agrees to
stop. Files in OUT: loading<rank> (before load_checkpoint), pid<rank>, progress<rank> (steps
done), agreed<rank> and stopped<rank> (the step it agreed to stop at, then saved at),
final<rank>.json (sha256 of the full weights, the loader lengths seen), resumed<rank>.
--hold-save GATE: after the agreed stop, save only once the file GATE exists (at most 120 s): a
slow save, for a second run to meet. --hold-exit GATE2: after that save, exit only once GATE2 exists.
"""
import argparse
import hashlib
import json
import math
import os
import time
from pathlib import Path

import deepspeed
import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--sleep", type=float, default=0.05)
parser.add_argument("--hold-save", type=Path)
parser.add_argument("--hold-exit", type=Path)
parser.add_argument("--local_rank", type=int, help="added by the deepspeed launcher; unused")
args = parser.parse_args()


def hold(gate: Path | None) -> None:
    deadline = time.monotonic() + 120
    while gate is not None and not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


args.out.mkdir(parents=True, exist_ok=True)
ctx = toolkit.init_distributed()
toolkit.seed_everything(1234)
hparams = toolkit.get_hparams()  # outside any trial or YAML: {} (the defaults below apply)
lr = hparams.get("lr", 1e-2)
VOCAB, SEQ, MB, GA = 32, 8, 2, 2
data = TensorDataset(torch.randint(0, VOCAB, (120, SEQ)))
model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, VOCAB))
sampler = toolkit.ResumableDistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, seed=7,
                                              drop_last=True)
loader = DataLoader(data, batch_size=MB, sampler=sampler, drop_last=True, generator=sampler.loader_generator)
# DeepSpeed-Chat: num_update_steps_per_epoch = ceil(len(train_dataloader) / gradient_accumulation_steps)
updates_per_epoch = math.ceil(len(loader) / GA)
config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA, "steps_per_print": 10**9,
          "optimizer": {"type": "Adam", "params": {"lr": lr}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": lr,
                                                           "total_num_steps": 3 * updates_per_epoch}},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 5_000_000,
                                "allgather_bucket_size": 5_000_000}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
ckpt = args.out / "ckpt"
write(args.out / f"loading{ctx.rank}", str(os.getpid()))
resumed = toolkit.load_checkpoint(engine, ckpt)
steps = resumed[0] if resumed else 0
if resumed:
    write(args.out / f"resumed{ctx.rank}", str(steps))
write(args.out / f"pid{ctx.rank}", str(os.getpid()))
stream = toolkit.micro_batches(loader, sampler, steps_completed=steps, gradient_accumulation_steps=GA)
lengths = set()
with toolkit.watch_preemption(ctx, check_interval=0.2) as preemption:
    while steps < args.steps:
        for _ in range(GA):
            (tokens,) = next(stream)
            logits = engine(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
        lengths.add(len(loader))  # DeepSpeed-Chat reads it for epochs and step labels
        steps += 1
        write(args.out / f"progress{ctx.rank}", str(steps))
        time.sleep(args.sleep)
        if preemption.should_preempt():
            write(args.out / f"agreed{ctx.rank}", str(steps))
            hold(args.hold_save)
            toolkit.save_checkpoint(engine, ckpt, steps_completed=steps)
            write(args.out / f"stopped{ctx.rank}", str(steps))
            break
params = [p.detach() for p in engine.module.parameters()]
digest = hashlib.sha256(b"".join(p.contiguous().numpy().tobytes() for p in params)).hexdigest()
if preemption.preempted:
    hold(args.hold_exit)
else:
    write(args.out / f"final{ctx.rank}.json", json.dumps({"sha256": digest, "lengths": sorted(lengths),
                                                          "updates_per_epoch": updates_per_epoch}))
