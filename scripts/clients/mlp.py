"""A user's own training loop, as a hidden client of dsat would be: an MLP on random data, no
helpers beyond the toolkit calls a user makes. ``scripts/bench_memory.py --examples mlp`` tunes
it (the memory model's predicted largest micro-batch against the boundary real trials find).

Run it (from the repository root)::

    torchrun --nproc_per_node 2 scripts/clients/mlp.py --width 1024 --layers 4
    python -m toolkit.dsat binary scripts/clients/mlp.yaml scripts/clients --memory-per-slot 1GiB
    python scripts/bench_memory.py --examples mlp --set width=1024 depth=4 inputs=1024

``--width``/``--layers`` (the hidden ``width x width`` blocks, ``depth`` in the YAML) override the
hyperparameters; under dsat set them in the YAML (or ``bench_memory.py --set``).
"""
import argparse
from pathlib import Path

import deepspeed
import torch
from torch import nn

import toolkit


def main() -> None:
    parser = argparse.ArgumentParser(description="an MLP on random data, a user's own DeepSpeed loop")
    parser.add_argument("--width", type=int, default=None, help="hidden width (default: the YAML's width)")
    parser.add_argument("--layers", type=int, default=None,
                        help="hidden width x width blocks (default: the YAML's depth)")
    args = parser.parse_args()
    ctx = toolkit.init_distributed()
    here = Path(__file__).parent
    hparams = dict(toolkit.get_hparams(here / "mlp.yaml"))  # in a dsat trial: the trial's hyperparameters
    hparams.update({k: v for k, v in (("width", args.width), ("depth", args.layers)) if v is not None})
    ds_config = toolkit.get_ds_config_from_hparams(hparams, base_dir=here)
    torch.manual_seed(0)
    width, inputs, classes = hparams["width"], hparams["inputs"], hparams["classes"]
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(hparams["depth"])]
    model = nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), *blocks, nn.Linear(width, classes))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    micro_batch = engine.train_micro_batch_size_per_gpu()
    for _ in range(hparams["steps"]):
        with toolkit.dsat_reporting_context(engine):
            for _ in range(engine.gradient_accumulation_steps()):
                x = torch.randn(micro_batch, inputs, device=ctx.device)
                y = torch.randint(0, classes, (micro_batch,), device=ctx.device)
                loss = nn.functional.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()


if __name__ == "__main__":
    main()
