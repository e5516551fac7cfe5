"""Causal language modelling with a GPT-2-style ``transformers`` model on synthetic tokens (ZeRO 2).

The model most DeepSpeed users train, built from a config (random initialisation: nothing is
downloaded, ``HF_HUB_OFFLINE=1``), trained with every toolkit helper. Install the optional extra
first, then run it::

    pip install -e '.[hf]'                  # transformers
    torchrun --nproc_per_node 2 examples/core_api/causal_lm.py
    LOCAL_SIZE=2 deepspeed --num_gpus 2 examples/core_api/causal_lm.py

Stop it at any moment and run it again: it resumes from its last checkpoint and ends bitwise
equal to a run that was never stopped. TensorBoard: ``tensorboard --logdir runs``. Autotune it
with ``python -m toolkit.dsat binary examples/core_api/causal_lm.yaml examples/core_api``.
"""

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config, never a download

import deepspeed  # noqa: E402
import torch  # noqa: E402
from common import HERE, RandomTokens, make_loader, parse_args, preemption_args, setup  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import toolkit  # noqa: E402

logger = logging.getLogger("causal_lm")


def build_model(hparams: dict) -> GPT2LMHeadModel:
    """A GPT-2 of the hyperparameters' size, randomly initialised (seeded by the caller)."""
    config = GPT2Config(vocab_size=hparams["vocab_size"], n_positions=hparams["seq_len"],
                        n_embd=hparams["d_model"], n_layer=hparams["num_layers"], n_head=hparams["num_heads"],
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False)
    return GPT2LMHeadModel(config)


def lm_loss(engine, ids: torch.Tensor, *, device) -> torch.Tensor:
    """Next-token cross-entropy (transformers shifts the labels itself)."""
    ids = ids.to(device)
    return engine(input_ids=ids, labels=ids).loss


def main() -> None:
    args = parse_args("causal_lm.yaml", __doc__.splitlines()[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ctx, hparams, max_steps, out = setup(args)
    ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size, base_dir=HERE,
                                        device=ctx.device, hidden_size=hparams["d_model"])
    seed = hparams.get("seed", 0)
    toolkit.seed_everything(seed, deterministic=hparams.get("deterministic", False))
    model = build_model(hparams)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    data = RandomTokens(hparams["dataset_size"], vocab_size=hparams["vocab_size"], seq_len=hparams["seq_len"],
                        seed=seed)
    loader, sampler = make_loader(data, num_replicas=ctx.world_size, rank=ctx.rank,
                                  micro_batch=engine.train_micro_batch_size_per_gpu(), seed=seed)
    validation = DataLoader(RandomTokens(128, vocab_size=hparams["vocab_size"], seq_len=hparams["seq_len"],
                                         seed=seed + 1), batch_size=32)

    resumed = toolkit.load_checkpoint(engine, out / "checkpoints")
    steps_completed = resumed[0] if resumed else 0
    grad_acc = engine.gradient_accumulation_steps()
    stream = toolkit.micro_batches(loader, sampler, steps_completed=steps_completed,
                                   gradient_accumulation_steps=grad_acc)
    samples_per_step = engine.train_micro_batch_size_per_gpu() * grad_acc

    with toolkit.MetricsWriter(ctx, out / "tensorboard", resume_step=steps_completed) as metrics, \
            toolkit.watch_preemption(ctx, **preemption_args(hparams)) as preemption:
        while steps_completed < max_steps:
            with toolkit.dsat_reporting_context(engine):
                for _ in range(grad_acc):
                    loss = lm_loss(engine, next(stream), device=ctx.device)
                    engine.backward(loss)
                    engine.step()
            steps_completed += 1
            metrics.report_training_metrics(steps_completed, {"loss": loss.detach()}, samples=samples_per_step)
            if ctx.is_chief and steps_completed % hparams.get("log_every", 20) == 0:
                logger.info("step %d of %d: loss %.4f", steps_completed, max_steps, float(loss))
            if steps_completed % hparams["validate_every"] == 0 or steps_completed == max_steps:
                engine.eval()
                with torch.no_grad():
                    losses = [float(lm_loss(engine, ids, device=ctx.device)) for ids in validation]
                engine.train()
                metrics.report_validation_metrics(steps_completed, {"loss": sum(losses) / len(losses)})
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
