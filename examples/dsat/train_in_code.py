"""A script that builds its DeepSpeed config in code, as HelloDeepSpeed does: ``deepspeed.initialize(config=dict)``.

Run it by hand (on GPUs drop LOCAL_SIZE and use --num_gpus = GPUs per node), then tune it::

    LOCAL_SIZE=2 deepspeed --num_gpus 2 examples/dsat/train_in_code.py
    torchrun --nproc_per_node 2 examples/dsat/train_in_code.py
    python -m toolkit.dsat binary examples/dsat/in_code.yaml examples/dsat --metric throughput

The YAML names no config: dsat's first profiling trial records the dict below as this script
gives it to ``deepspeed.initialize``, plans from it, and merges each trial's tuned keys
(micro-batch, accumulation, global batch, ``zero_optimization``) over it. The best config is this
dict with the tuned keys, as JSON. The only dsat line is ``toolkit.dsat_reporting_context``.
"""

import argparse

import deepspeed
import torch

import toolkit

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000},
    "steps_per_print": 1_000_000,
}


def main() -> None:
    parser = argparse.ArgumentParser(description="an MLP on random data, its DeepSpeed config built in code")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    batch = engine.train_micro_batch_size_per_gpu()   # what dsat tunes: the data follows the engine
    for step in range(args.steps * engine.gradient_accumulation_steps()):
        x = torch.randn(batch, 128, device=engine.device)
        with toolkit.dsat_reporting_context(engine):  # the only dsat line
            loss = torch.nn.functional.mse_loss(engine(x), x)
            engine.backward(loss)
            engine.step()
        if engine.global_rank == 0 and engine.is_gradient_accumulation_boundary() and step % 20 == 0:
            print(f"step {engine.global_steps}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
