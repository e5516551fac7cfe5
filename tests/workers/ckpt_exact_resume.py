"""Exact resume, the whole remaining run compared: ZeRO 0-3 and the pipeline engine, 2 ranks.

Usage: torchrun --nproc_per_node 2 ckpt_exact_resume.py OUT_DIR train|resume [options]

Every run: ``make_layers`` (with dropout), data drawn from the global RNG, gradient accumulation 2,
gradient clipping, DeepSpeed's WarmupDecayLR scheduler, and one of three Adams:
    ds       ``"optimizer": {"type": "Adam"}``: FusedAdam's CPU build (one kernel per process)
    offload  the same with ``offload_optimizer: cpu``: DeepSpeedCPUAdam (ZeRO 1-3 only)
    torch    a client ``torch.optim.Adam`` with ``"zero_force_ds_cpu_optimizer": false``
A case is ``<engine>-<adam>``: ``zero3-ds``, ``pipe-torch``, ...

  train:  per case, an uninterrupted run of --steps steps that also saves at --fixed (the losses of
          every micro-batch and the final weights are written), then, per --points P, a run from
          scratch under ``toolkit.watch_preemption(check_every=1)`` in which rank 1 sends itself
          SIGTERM in the middle of step P (between its micro-batches); every rank stops at the
          agreed step and saves there, as the README's loop does.
  resume: per case and checkpoint, a fresh engine loads it with ``toolkit.load_checkpoint`` and
          trains to --steps; its losses and final weights are compared, bitwise, with the
          uninterrupted run's. Each resume starts from a CPU Adam kernel left at another step (the
          previous run's last), as a new process's would be. With --without-replay, the first
          preemption checkpoint of every ``-ds`` case is also resumed with toolkit's optimizer
          state restore switched off, to show that the comparison can fail.

Writes OUT_DIR/<mode>_rank<N>.json. A pipeline case must come last (DeepSpeed's global
model-parallel state stays behind after a pipeline engine).
"""
import argparse
import json
import os
import signal
from pathlib import Path

import ckpt_common as c
import deepspeed
import torch
from deepspeed.pipe import PipelineModule

import toolkit
import toolkit.checkpoint.api as tkc

GA = 2

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("mode", choices=("train", "resume"))
parser.add_argument("--cases", default="zero0-ds,zero1-ds,zero2-ds,zero3-ds,zero3-offload,"
                                       "zero0-torch,zero1-torch,zero2-torch,zero3-torch,pipe-ds,pipe-torch")
parser.add_argument("--steps", type=int, default=42)
parser.add_argument("--fixed", type=int, default=0,
                    help="step of the fixed save in the uninterrupted run (0: none)")
parser.add_argument("--points", default="19", help="steps at which rank 1 gets SIGTERM, comma-separated")
parser.add_argument("--without-replay", action="store_true")
args = parser.parse_args()
cases = args.cases.split(",")
points = [int(p) for p in args.points.split(",") if p]
ctx = toolkit.init_distributed()


def config(case):
    engine, adam = case.split("-")
    stage = 0 if engine == "pipe" else int(engine[-1])
    zero = {"stage": stage, **c.SMALL_BUCKETS}
    if stage == 3:
        zero["sub_group_size"] = 100  # several sub-groups: the replay must follow ZeRO-3's call order
    if adam == "offload":
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GA, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "zero_optimization": zero,
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                            "warmup_num_steps": 5, "total_num_steps": 100}}}
    if adam == "torch":
        cfg["zero_force_ds_cpu_optimizer"] = False
    else:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
    return cfg


def build(case):
    torch.manual_seed(1234)  # the same initial weights in every run of a case
    engine_kind, adam = case.split("-")
    if engine_kind == "pipe":
        model = PipelineModule(layers=c.make_layers(), num_stages=2, loss_fn=c._mse,
                               partition_method="uniform")
    else:
        model = torch.nn.Sequential(*c.make_layers())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2) if adam == "torch" else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model.parameters(),
                                      config=config(case))
    base = type(engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer)
    expected = {"ds": "FusedAdam", "offload": "DeepSpeedCPUAdam", "torch": "Adam"}[adam]
    assert base.__name__ == expected, (case, base)
    return engine


def step(engine, signal_at_micro=None):
    """One optimizer step of GA micro-batches; the losses of each, as floats."""
    if isinstance(engine.module, PipelineModule):
        batches = [c.batch() for _ in range(GA)]
        if signal_at_micro is not None:
            os.kill(os.getpid(), signal.SIGTERM)
        return [engine.train_batch(data_iter=iter(batches)).item()]
    losses = []
    for micro in range(GA):
        if micro == signal_at_micro:
            os.kill(os.getpid(), signal.SIGTERM)  # mid-step, between micro-batches
        x, y = c.batch()
        loss = c._mse(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def weights(engine):
    return {name: t.tolist() for name, t in c.full_params(engine).items()}


def train_uninterrupted(case):
    engine = build(case)
    losses = []
    for done in range(args.steps):
        if args.fixed and done == args.fixed:
            toolkit.save_checkpoint(engine, args.out / case / "fixed", steps_completed=done)
        losses.append(step(engine))
    return {"losses": losses, "weights": weights(engine)}


def train_preempted(case, point):
    """From scratch; SIGTERM on rank 1 during step ``point`` (1-based); save where every rank stops."""
    engine = build(case)
    directory = args.out / case / f"preempt{point}"
    with toolkit.watch_preemption(ctx, check_every=1) as preemption:
        for done in range(args.steps):
            step(engine, signal_at_micro=1 if ctx.rank == 1 and done + 1 == point else None)
            if preemption.should_preempt():
                toolkit.save_checkpoint(engine, directory, steps_completed=done + 1)
                return {"stopped_at": done + 1, "dir": str(directory)}
    return {"stopped_at": None, "dir": str(directory)}


def resume(case, directory, *, replay=True):
    restore = tkc.replay_cpu_adam_state
    replayed = []
    tkc.replay_cpu_adam_state = (lambda e: replayed.append(restore(e)) or replayed[-1]) if replay else (
        lambda e: replayed.append(0) or 0)
    try:
        engine = build(case)
        start, _ = toolkit.load_checkpoint(engine, directory)
    finally:
        tkc.replay_cpu_adam_state = restore
    losses = [step(engine) for _ in range(start, args.steps)]
    return {"start": start, "losses": losses, "weights": weights(engine), "replayed": replayed}


record = {}
if args.mode == "train":
    for case in cases:
        record[case] = {"reference": train_uninterrupted(case),
                        "preempted": {str(p): train_preempted(case, p) for p in points}}
else:
    trained = json.loads((args.out / f"train_rank{ctx.rank}.json").read_text())
    for case in cases:
        runs = {}
        if args.fixed:
            runs["fixed"] = resume(case, args.out / case / "fixed")
        for p, info in trained[case]["preempted"].items():
            runs[f"preempt{p}"] = resume(case, info["dir"])
        if args.without_replay and case.endswith("-ds") and points:
            first = trained[case]["preempted"][str(points[0])]["dir"]
            runs["without_replay"] = resume(case, first, replay=False)
        record[case] = runs
c.write_json(args.out / f"{args.mode}_rank{ctx.rank}.json", record)
