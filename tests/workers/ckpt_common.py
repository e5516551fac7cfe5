"""Shared by the ckpt_* workers: a tiny model, DeepSpeed engines for each case, one training step."""
import json
import os
from pathlib import Path

import deepspeed
import torch
from deepspeed.pipe import PipelineModule

# DeepSpeed's default ZeRO buckets (5e8 elements) cost 2 GB of allocations per step on CPU; these
# tiny models need a fraction of that, and the suite's time is spent elsewhere then.
SMALL_BUCKETS = {"reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}
CASES = ("zero0", "zero1", "zero2", "zero3", "pipe")


def ds_config(stage, **checkpoint):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, **SMALL_BUCKETS}, "steps_per_print": 10**9}
    if checkpoint:
        config["checkpoint"] = checkpoint
    return config


def make_layers():
    # Dropout: a training step draws from torch's RNG, so a resume must restore it to match.
    return [torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 16),
            torch.nn.Tanh(), torch.nn.Linear(16, 2)]


def _mse(out, target):
    return ((out - target) ** 2).mean()


def build(case, *, seed=0, **checkpoint):
    """A fresh engine; ``seed`` sets the initial weights (a load must overwrite them)."""
    torch.manual_seed(seed)
    if case == "pipe":
        model = PipelineModule(layers=make_layers(), num_stages=2, loss_fn=_mse, partition_method="uniform")
        stage = 0
    else:
        model = torch.nn.Sequential(*make_layers())
        stage = int(case[-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage, **checkpoint))
    return engine


def batch():
    # Drawn from the global RNG: the same data after a resume only if the RNG states were restored.
    return torch.randn(2, 4), torch.randn(2, 2)


def train_step(engine):
    if isinstance(engine.module, PipelineModule):
        return engine.train_batch(data_iter=iter([batch()])).item()
    x, y = batch()
    loss = _mse(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def local_params(engine):
    """This rank's share of the parameters (its shard under ZeRO-3), as flat float lists."""
    out = []
    for param in engine.module.parameters():
        tensor = param.ds_tensor if hasattr(param, "ds_tensor") else param
        out.append(tensor.detach().reshape(-1).tolist())
    return out


def full_params(engine):
    """The full named parameters this rank holds (all of them, or its stages'). Call on all ranks."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(p, "ds_id") for p in params)):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def tensors_of(obj):
    """Every tensor in a nested optimizer state_dict, in a stable order, as flat lists."""
    if torch.is_tensor(obj):
        return [obj.detach().float().reshape(-1).tolist()]
    if isinstance(obj, dict):
        return [t for key in sorted(obj, key=str) for t in tensors_of(obj[key])]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_of(item)]
    return []


def write_json(path, record):
    Path(path).write_text(json.dumps(record))


def rank():
    return int(os.environ.get("RANK", "0"))
