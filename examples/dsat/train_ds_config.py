"""A DeepSpeed script in the field's own convention: ``--deepspeed_config`` and ``deepspeed.initialize(args=args)``.

Run it by hand (on GPUs drop LOCAL_SIZE and use --num_gpus = GPUs per node), then tune it::

    LOCAL_SIZE=2 deepspeed --num_gpus 2 examples/dsat/train_ds_config.py --deepspeed --deepspeed_config examples/dsat/ds_config.json
    torchrun --nproc_per_node 2 examples/dsat/train_ds_config.py --deepspeed --deepspeed_config examples/dsat/ds_config.json
    python -m toolkit.dsat binary examples/dsat/ds_config_flag.yaml examples/dsat --metric throughput

dsat starts the search from the file the entrypoint names (``ds_config.json``) and gives each
trial its own file in its place. The one dsat line, ``toolkit.dsat_reporting_context``, times
each step (a no-op outside a trial); without it dsat times the engine's own steps.
"""

import argparse

import deepspeed
import torch

import toolkit


def main() -> None:
    parser = argparse.ArgumentParser(description="an MLP on random data, configured by --deepspeed_config")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)   # --deepspeed, --deepspeed_config
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
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
