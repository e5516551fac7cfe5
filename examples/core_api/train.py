"""Data-parallel ZeRO training of a small ResNet-style classifier on random ImageNet-like images.

Run it (from any directory; on GPUs drop LOCAL_SIZE and use --num_gpus = GPUs per node)::

    torchrun --nproc_per_node 2 examples/core_api/train.py
    LOCAL_SIZE=2 deepspeed --num_gpus 2 examples/core_api/train.py
    python examples/core_api/train.py                       # one process

Stop it at any moment (Ctrl-C, ``kill -TERM``, a scheduler's preemption) and start the same
command again: it saves a checkpoint when told to stop and continues exactly where it stopped.
Watch it with ``tensorboard --logdir runs``. Find its fastest DeepSpeed config with::

    python -m toolkit.dsat binary examples/core_api/deepspeed.yaml examples/core_api

Every toolkit helper appears below: init_distributed, get_hparams, build_ds_config (which uses
get_ds_config_from_hparams), MetricsWriter, save/load_checkpoint, watch_preemption, the
resumable sampler, and dsat_reporting_context.
"""

import logging

import deepspeed
import torch
import torch.nn.functional as F
from common import HERE, RandomImages, input_dtype, make_loader, parse_args, preemption_args, setup
from torch import nn
from torch.utils.data import DataLoader

import toolkit

logger = logging.getLogger("train")


class Block(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.skip = (nn.Sequential() if stride == 1 and channels_in == channels_out else
                     nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                   nn.BatchNorm2d(channels_out)))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNet(nn.Module):
    """A ResNet-10-ish network (torchvision has no CPU build here, so it is defined in place)."""

    def __init__(self, *, width: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2),
                                    Block(2 * width, 4 * width, 2), Block(4 * width, 8 * width, 2))
        self.head = nn.Linear(8 * width, num_classes)

    def forward(self, x):
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def evaluate(engine, loader: DataLoader, device) -> dict:
    engine.eval()
    total_loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            logits = engine(x.to(device, dtype=input_dtype(engine)))
            total_loss += float(F.cross_entropy(logits, y.to(device), reduction="sum"))
            correct += int((logits.argmax(1).cpu() == y).sum())
            count += len(y)
    engine.train()
    return {"loss": total_loss / count, "accuracy": correct / count}


def main() -> None:
    args = parse_args("deepspeed.yaml", __doc__.splitlines()[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ctx, hparams, max_steps, out = setup(args)
    ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size, base_dir=HERE,
                                        device=ctx.device)
    seed = hparams.get("seed", 0)
    toolkit.seed_everything(seed, deterministic=hparams.get("deterministic", False))
    model = ResNet(width=hparams["width"], num_classes=hparams["num_classes"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    data = RandomImages(hparams["dataset_size"], image_size=hparams["image_size"],
                        num_classes=hparams["num_classes"], seed=seed)
    loader, sampler = make_loader(data, num_replicas=ctx.world_size, rank=ctx.rank,
                                  micro_batch=engine.train_micro_batch_size_per_gpu(), seed=seed)
    validation = DataLoader(RandomImages(256, image_size=hparams["image_size"], num_classes=hparams["num_classes"],
                                         seed=seed + 1), batch_size=64)

    resumed = toolkit.load_checkpoint(engine, out / "checkpoints")
    steps_completed = resumed[0] if resumed else 0
    if resumed:
        logger.info("resumed at step %d of %d", steps_completed, max_steps)
    grad_acc = engine.gradient_accumulation_steps()
    stream = toolkit.micro_batches(loader, sampler, steps_completed=steps_completed,
                                   gradient_accumulation_steps=grad_acc)
    samples_per_step = engine.train_micro_batch_size_per_gpu() * grad_acc
    dtype = input_dtype(engine)  # bf16/fp16 runs: the images in the model's dtype

    with toolkit.MetricsWriter(ctx, out / "tensorboard", resume_step=steps_completed) as metrics, \
            toolkit.watch_preemption(ctx, **preemption_args(hparams)) as preemption:
        while steps_completed < max_steps:
            # dsat times this step inside an autotuning trial; elsewhere the context does nothing.
            with toolkit.dsat_reporting_context(engine):
                for _ in range(grad_acc):
                    x, y = next(stream)
                    loss = F.cross_entropy(engine(x.to(ctx.device, dtype=dtype)), y.to(ctx.device))
                    engine.backward(loss)
                    engine.step()
            steps_completed += 1
            metrics.report_training_metrics(steps_completed, {"loss": loss.detach()}, samples=samples_per_step)
            if ctx.is_chief and steps_completed % hparams.get("log_every", 20) == 0:
                logger.info("step %d of %d: loss %.4f", steps_completed, max_steps, float(loss))
            if steps_completed % hparams["validate_every"] == 0 or steps_completed == max_steps:
                metrics.report_validation_metrics(steps_completed, evaluate(engine, validation, ctx.device))
            stop = preemption.should_preempt()
            if stop or steps_completed % hparams["checkpoint_every"] == 0 or steps_completed == max_steps:
                toolkit.save_checkpoint(engine, out / "checkpoints", steps_completed=steps_completed, keep_last=2)
            if stop:
                logger.info("preempted (%s) at step %d: checkpoint saved, exiting; run again to resume",
                            preemption.received_signal, steps_completed)
                break
    if ctx.is_chief:
        logger.info("done at step %d; TensorBoard: tensorboard --logdir %s", steps_completed, out)


if __name__ == "__main__":
    main()
