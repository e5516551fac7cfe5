"""Masked-language-model training of a small Transformer encoder on synthetic tokens (ZeRO 2).

The HelloDeepSpeed MLM recipe on data made in place: 15% of the tokens are masked and the model
predicts them. Run it::

    torchrun --nproc_per_node 2 examples/core_api/mlm.py
    LOCAL_SIZE=2 deepspeed --num_gpus 2 examples/core_api/mlm.py

Stop it at any moment and run it again: it resumes from its last checkpoint (the masking RNG
included). TensorBoard: ``tensorboard --logdir runs``. Autotune it with
``python -m toolkit.dsat random examples/core_api/mlm.yaml examples/core_api``.
"""

import logging

import deepspeed
import torch
import torch.nn.functional as F
from common import HERE, RandomTokens, make_loader, parse_args, preemption_args, setup
from torch import nn
from torch.utils.data import DataLoader

import toolkit

logger = logging.getLogger("mlm")
PAD, MASK = 0, 1


class Encoder(nn.Module):
    def __init__(self, *, vocab_size: int, seq_len: int, d_model: int, num_layers: int, num_heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, num_heads, 4 * d_model, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids):
        return self.head(self.encoder(self.tokens(ids) + self.positions))


def mask_tokens(ids: torch.Tensor, *, vocab_size: int):
    """BERT's recipe: 15% of positions are targets; 80% of those become [MASK], 10% random, 10% kept."""
    targets = torch.full_like(ids, -100)
    chosen = torch.rand(ids.shape) < 0.15
    targets[chosen] = ids[chosen]
    inputs = ids.clone()
    roll = torch.rand(ids.shape)
    inputs[chosen & (roll < 0.8)] = MASK
    randomised = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[randomised] = torch.randint(2, vocab_size, (int(randomised.sum()),))
    return inputs, targets


def mlm_loss(engine, ids, *, vocab_size: int, device):
    inputs, targets = mask_tokens(ids, vocab_size=vocab_size)
    logits = engine(inputs.to(device))
    return F.cross_entropy(logits.reshape(-1, vocab_size), targets.to(device).reshape(-1), ignore_index=-100)


def main() -> None:
    args = parse_args("mlm.yaml", __doc__.splitlines()[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ctx, hparams, max_steps, out = setup(args)
    ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size, base_dir=HERE,
                                        device=ctx.device, hidden_size=hparams["d_model"])
    seed = hparams.get("seed", 0)
    toolkit.seed_everything(seed, deterministic=hparams.get("deterministic", False))
    vocab = hparams["vocab_size"]
    model = Encoder(vocab_size=vocab, seq_len=hparams["seq_len"], d_model=hparams["d_model"],
                    num_layers=hparams["num_layers"], num_heads=hparams["num_heads"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    data = RandomTokens(hparams["dataset_size"], vocab_size=vocab, seq_len=hparams["seq_len"], seed=seed)
    loader, sampler = make_loader(data, num_replicas=ctx.world_size, rank=ctx.rank,
                                  micro_batch=engine.train_micro_batch_size_per_gpu(), seed=seed)
    validation = DataLoader(RandomTokens(256, vocab_size=vocab, seq_len=hparams["seq_len"], seed=seed + 1),
                            batch_size=64)

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
                    loss = mlm_loss(engine, next(stream), vocab_size=vocab, device=ctx.device)
                    engine.backward(loss)
                    engine.step()
            steps_completed += 1
            metrics.report_training_metrics(steps_completed, {"loss": loss.detach()}, samples=samples_per_step)
            if ctx.is_chief and steps_completed % hparams.get("log_every", 20) == 0:
                logger.info("step %d of %d: loss %.4f", steps_completed, max_steps, float(loss))
            if steps_completed % hparams["validate_every"] == 0 or steps_completed == max_steps:
                # Validation masks with its own generator so it neither draws from nor depends on the
                # training RNG stream (an exact resume needs that stream untouched).
                engine.eval()
                with torch.no_grad(), torch.random.fork_rng():
                    torch.manual_seed(seed + 2)
                    losses = [float(mlm_loss(engine, ids, vocab_size=vocab, device=ctx.device)) for ids in validation]
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
