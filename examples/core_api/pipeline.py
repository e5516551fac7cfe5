"""Pipeline-parallel training (DeepSpeed ``PipelineModule``, 2 stages) of a small CNN on random images.

Run it (the world size must be a multiple of ``pipeline_stages`` in pipeline.yaml)::

    torchrun --nproc_per_node 2 examples/core_api/pipeline.py
    LOCAL_SIZE=2 deepspeed --num_gpus 2 examples/core_api/pipeline.py

The pipeline engine pulls ``gradient_accumulation_steps`` micro-batches per ``train_batch()``
and ``eval_batch()`` call, so the validation loader yields at least that many batches. Stop it at
any moment and run it again: it resumes from its last checkpoint. TensorBoard:
``tensorboard --logdir runs``. Pipelines run with ZeRO stage 0 or 1 only; build_ds_config rejects
anything else before DeepSpeed starts.
"""

import logging

import deepspeed
from common import HERE, RandomImages, input_dtype, make_loader, parse_args, setup
from deepspeed.pipe import PipelineModule
from torch import nn
from torch.utils.data import DataLoader

import toolkit

logger = logging.getLogger("pipeline")


def layers(*, width: int, num_classes: int) -> list:
    """The network as a flat list of layers, which PipelineModule partitions into stages."""
    return [nn.Conv2d(3, width, 3, 1, 1), nn.ReLU(), nn.Conv2d(width, 2 * width, 3, 2, 1), nn.ReLU(),
            nn.Conv2d(2 * width, 4 * width, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(4 * width, 4 * width), nn.ReLU(), nn.Linear(4 * width, num_classes)]


def main() -> None:
    args = parse_args("pipeline.yaml", __doc__.splitlines()[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ctx, hparams, max_steps, out = setup(args)
    stages = hparams["pipeline_stages"]
    if ctx.world_size % stages:
        raise SystemExit(f"world size {ctx.world_size} is not a multiple of pipeline_stages={stages}")
    data_parallel = ctx.world_size // stages
    ds_config = toolkit.build_ds_config(hparams, data_parallel_size=data_parallel, base_dir=HERE,
                                        pipeline=True, device=ctx.device)
    seed = hparams.get("seed", 0)
    toolkit.seed_everything(seed, deterministic=hparams.get("deterministic", False))
    model = PipelineModule(layers=layers(width=hparams["width"], num_classes=hparams["num_classes"]),
                           loss_fn=nn.CrossEntropyLoss(), num_stages=stages, partition_method="parameters")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    # Each data-parallel replica reads its own share; both stages of a replica read the same
    # batches (the first stage uses the inputs, the last the labels).
    data = RandomImages(hparams["dataset_size"], image_size=hparams["image_size"],
                        num_classes=hparams["num_classes"], seed=seed)
    loader, sampler = make_loader(data, num_replicas=data_parallel, rank=engine.grid.get_data_parallel_rank(),
                                  micro_batch=engine.train_micro_batch_size_per_gpu(), seed=seed)
    grad_acc = engine.gradient_accumulation_steps()
    validation_set = RandomImages(engine.train_micro_batch_size_per_gpu() * grad_acc, seed=seed + 1,
                                  image_size=hparams["image_size"], num_classes=hparams["num_classes"])
    validation = DataLoader(validation_set, batch_size=engine.train_micro_batch_size_per_gpu())

    resumed = toolkit.load_checkpoint(engine, out / "checkpoints")
    steps_completed = resumed[0] if resumed else 0
    dtype = input_dtype(engine)  # bf16/fp16 runs: the pipeline engine does not cast its inputs
    stream = ((x.to(dtype), y) for x, y in toolkit.micro_batches(loader, sampler, steps_completed=steps_completed,
                                                                  gradient_accumulation_steps=grad_acc))
    samples_per_step = engine.train_micro_batch_size_per_gpu() * grad_acc

    with toolkit.MetricsWriter(ctx, out / "tensorboard", resume_step=steps_completed) as metrics, \
            toolkit.watch_preemption(ctx) as preemption:
        while steps_completed < max_steps:
            with toolkit.dsat_reporting_context(engine):
                loss = engine.train_batch(data_iter=stream)   # grad_acc micro-batches, forward+backward+step
            steps_completed += 1
            metrics.report_training_metrics(steps_completed, {"loss": loss}, samples=samples_per_step)
            if ctx.is_chief and steps_completed % hparams.get("log_every", 20) == 0:
                logger.info("step %d of %d: loss %.4f", steps_completed, max_steps, float(loss))
            if steps_completed % hparams["validate_every"] == 0 or steps_completed == max_steps:
                # eval_batch pulls gradient_accumulation_steps micro-batches from the iterator.
                val_loss = engine.eval_batch(data_iter=((x.to(dtype), y) for x, y in validation))
                metrics.report_validation_metrics(steps_completed, {"loss": val_loss})
            stop = preemption.should_preempt()
            if stop or steps_completed % hparams["checkpoint_every"] == 0 or steps_completed == max_steps:
                toolkit.save_checkpoint(engine, out / "checkpoints", steps_completed=steps_completed, keep_last=2)
            if stop:
                logger.info("preempted at step %d: checkpoint saved; run again to resume", steps_completed)
                break
    if ctx.is_chief:
        logger.info("done at step %d; TensorBoard: tensorboard --logdir %s", steps_completed, out)


if __name__ == "__main__":
    main()
