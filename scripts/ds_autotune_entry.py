"""Training script for DeepSpeed's own autotuner: the example ResNet of examples/core_api/train.py.

DeepSpeed's autotuner (``deepspeed --autotuning tune``) launches this script once per experiment
with ``--deepspeed_config <base64 of the experiment's config>``; the engine itself writes the
experiment's metrics and exits after ``autotuning.end_profile_step``. :mod:`scripts.bench_dsat`
runs it like this (2 CPU ranks)::

    LOCAL_SIZE=2 deepspeed --autotuning tune --num_gpus 2 scripts/ds_autotune_entry.py \\
        --deepspeed_config ds_autotune.json --width 8 --image-size 16 --dataset-size 16384

It also trains on its own (no autotuning section in the config): ``--max-steps`` bounds the loop
either way, so a config whose autotuning never fires cannot run forever.

Model and data are those of the example (``ResNet`` from examples/core_api/train.py,
``RandomImages`` from examples/core_api/common.py), so DeepSpeed's autotuner and dsat tune the
same training step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "core_api"


def parse_args() -> argparse.Namespace:
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--local_rank", type=int, default=-1, help=argparse.SUPPRESS
    )  # the deepspeed launcher's
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--dataset-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max-steps", type=int, default=50, help="optimizer steps at most (safety bound)")
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    args = parser.parse_args()
    if args.deepspeed_config is None:
        parser.error(
            "--deepspeed_config is required (a JSON path, or the base64 config DeepSpeed's autotuner passes)"
        )
    return args


def main() -> None:
    for path in (str(ROOT), str(EXAMPLE)):
        if path not in sys.path:
            sys.path.insert(0, path)
    import deepspeed
    import torch.nn.functional as F
    from common import RandomImages
    from torch.utils.data import DataLoader, DistributedSampler
    from train import ResNet

    import toolkit

    args = parse_args()
    ctx = toolkit.init_distributed()
    toolkit.seed_everything(args.seed, deterministic=False)
    model = ResNet(width=args.width, num_classes=args.num_classes)
    # The config goes in as ``config=``: DeepSpeed asserts when it gets one through ``args`` as well.
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config)
    data = RandomImages(
        args.dataset_size, image_size=args.image_size, num_classes=args.num_classes, seed=args.seed
    )
    sampler: DistributedSampler = DistributedSampler(
        data, num_replicas=ctx.world_size, rank=ctx.rank, seed=args.seed, drop_last=True
    )
    loader = DataLoader(
        data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler, drop_last=True
    )
    if len(loader) == 0:
        raise SystemExit(f"--dataset-size {args.dataset_size}: {ctx.world_size} ranks x micro-batch "
                         f"{engine.train_micro_batch_size_per_gpu()} need more samples; raise --dataset-size")
    epoch = 0
    while engine.global_steps < args.max_steps:  # the autotuning engine exits by itself before this ends
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(engine(x.to(ctx.device)), y.to(ctx.device))
            engine.backward(loss)
            engine.step()
            if engine.global_steps >= args.max_steps:
                break
        epoch += 1


if __name__ == "__main__":
    main()
