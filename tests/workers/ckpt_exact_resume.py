"""Exact resume in a new process with DeepSpeed's own Adam (FusedAdam's CPU kernel), ZeRO-1, 2 ranks.

Usage: torchrun --nproc_per_node 2 ckpt_exact_resume.py OUT_DIR reference|resume
  reference: train STEPS steps, saving a checkpoint after RESUME_AT; write OUT_DIR/reference_rank<N>.pt
  resume:    in this new process, load that checkpoint and train to STEPS, twice: first with
             toolkit's CPU Adam replay switched off (what DeepSpeed alone gives), then with it;
             write OUT_DIR/without_replay_rank<N>.pt and OUT_DIR/resumed_rank<N>.pt
The weights written are the fp32 master weights of this rank's ZeRO partition and the module's.
"""
import sys
from pathlib import Path

import deepspeed
import torch

import toolkit
import toolkit.checkpoint.api as tkc

# float32 beta2**step by running product differs from pow(beta2, step) at steps 19..36 (and beta1
# at 27..31): a resume at 20 makes the first step after it use a different bias correction.
RESUME_AT, STEPS = 20, 26
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},  # DeepSpeed picks FusedAdam (CPU build)
          "gradient_clipping": 1.0, "zero_optimization": {"stage": 1, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}}

out, mode = Path(sys.argv[1]), sys.argv[2]
ctx = toolkit.init_distributed()


def build():
    toolkit.seed_everything(0, deterministic=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 4))
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    assert type(optimizer.optimizer).__name__ == "FusedAdam", type(optimizer.optimizer)
    return engine


def train(engine, start, stop):
    for _ in range(start, stop):
        x, y = torch.randn(4, 8), torch.randn(4, 4)  # the global RNG: restored by load_checkpoint
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()


def save_weights(engine, name):
    torch.save({"partition": [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups],
                "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}},
               out / f"{name}_rank{ctx.rank}.pt")


if mode == "reference":
    engine = build()
    train(engine, 0, RESUME_AT)
    toolkit.save_checkpoint(engine, out / "checkpoints", steps_completed=RESUME_AT)
    train(engine, RESUME_AT, STEPS)
    save_weights(engine, "reference")
else:
    replay = tkc.replay_cpu_adam_state
    # First without the replay: the kernel object of this process is fresh, as in any new process.
    tkc.replay_cpu_adam_state = lambda engine: 0
    engine = build()
    assert toolkit.load_checkpoint(engine, out / "checkpoints")[0] == RESUME_AT
    train(engine, RESUME_AT, STEPS)
    save_weights(engine, "without_replay")
    tkc.replay_cpu_adam_state = replay
    engine = build()
    assert toolkit.load_checkpoint(engine, out / "checkpoints")[0] == RESUME_AT
    train(engine, RESUME_AT, STEPS)
    save_weights(engine, "resumed")
