"""Train a few steps with deepspeed.initialize for ZeRO 0-3 and a PipelineModule, configs built by toolkit.

Usage: torchrun --nproc_per_node 2 engine_worker.py OUT_DIR
Writes OUT_DIR/engines_rank<N>.json with what each engine reported.
"""
import json
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.pipe import PipelineModule

import toolkit

out = Path(sys.argv[-1])
ctx = toolkit.init_distributed()
torch.manual_seed(0)
base = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "steps_per_print": 1000}
(out / "ds.json").write_text(json.dumps(base)) if ctx.is_chief else None
ctx.barrier()
report = {}


def layers():
    return [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]


for name, stage, pipeline in [("zero0", 0, False), ("zero1", 1, False), ("zero2", 2, False),
                              ("zero3", 3, False), ("pipe", 1, True)]:
    hparams = {"deepspeed_config": "ds.json",
               "overwrite_deepspeed_args": {
                   "train_micro_batch_size_per_gpu": 2,
                   # small buckets: DeepSpeed's default ones cost 2 GB of allocations per step on CPU
                   "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000,
                                         "allgather_bucket_size": 5_000_000}}}
    dp = ctx.world_size // 2 if pipeline else ctx.world_size
    ds_config = toolkit.build_ds_config(hparams, data_parallel_size=dp, base_dir=out, pipeline=pipeline,
                                        device=ctx.device)
    torch.manual_seed(1)
    if pipeline:
        model = PipelineModule(layers=layers(), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=2)
    else:
        model = torch.nn.Sequential(*layers())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=ds_config)
    gen = torch.Generator().manual_seed(ctx.rank)
    losses = []
    for _ in range(3):
        if pipeline:
            batches = iter([(torch.randn(2, 8, generator=gen), torch.randint(0, 4, (2,), generator=gen))
                            for _ in range(engine.gradient_accumulation_steps())])
            losses.append(float(engine.train_batch(batches)))
        else:
            for _ in range(engine.gradient_accumulation_steps()):
                x, y = torch.randn(2, 8, generator=gen), torch.randint(0, 4, (2,), generator=gen)
                loss = torch.nn.functional.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
            losses.append(float(loss))
    report[name] = {"stage": engine.zero_optimization_stage(), "train_batch_size": engine.train_batch_size(),
                    "micro": engine.train_micro_batch_size_per_gpu(),
                    "gas": engine.gradient_accumulation_steps(), "global_steps": engine.global_steps,
                    "losses": losses, "pipeline": pipeline}
    engine.destroy() if hasattr(engine, "destroy") else None
(out / f"engines_rank{ctx.rank}.json").write_text(json.dumps(report))
