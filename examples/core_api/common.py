"""Plumbing shared by the examples: arguments, synthetic data sets, the loader.

Nothing toolkit-specific hides here: every toolkit helper is called in the example scripts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import toolkit

HERE = Path(__file__).resolve().parent


def parse_args(default_config: str, description: str) -> argparse.Namespace:
    """Common flags. ``--local_rank`` is accepted because the deepspeed launcher passes it."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, default=HERE / default_config,
                        help=f"experiment YAML (default: {default_config} beside this script)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="checkpoints and TensorBoard logs "
                             "(default: $TOOLKIT_OUTPUT_DIR or ./runs/<name>)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="default: searcher.max_length of the config")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.max_steps is not None and args.max_steps < 0:
        parser.error(f"--max-steps {args.max_steps}: expected a number of steps >= 0")
    return args


def setup(args: argparse.Namespace):
    """The context, hyperparameters, max steps and output directory of a run. Call on all ranks."""
    ctx = toolkit.init_distributed()
    experiment = toolkit.load_experiment_config(args.config)
    hparams = toolkit.get_hparams(args.config)  # a dsat trial's own hyperparameters inside a trial
    max_steps = (args.max_steps if args.max_steps is not None
                 else toolkit.max_length_steps(experiment, default=100))
    out = args.output_dir or toolkit.get_output_dir(Path("runs") / experiment.get("name", "run"))
    return ctx, hparams, max_steps, out


class RandomImages(Dataset):
    """ImageNet-like random images whose label is learnable: a class prototype plus noise.

    Sample ``i`` is the same on every rank and every run (seeded by ``seed`` and ``i``).
    """

    def __init__(self, size: int, *, image_size: int, num_classes: int, seed: int) -> None:
        self.size, self.image_size, self.num_classes, self.seed = size, image_size, num_classes, seed
        gen = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn(num_classes, 3, image_size, image_size, generator=gen)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(torch.randint(0, self.num_classes, (1,), generator=gen))
        noise = torch.randn(3, self.image_size, self.image_size, generator=gen)
        return self.prototypes[label] * 0.5 + noise, label


class RandomTokens(Dataset):
    """Synthetic token sequences with structure to learn: each is a random walk over the vocabulary."""

    def __init__(self, size: int, *, vocab_size: int, seq_len: int, seed: int) -> None:
        self.size, self.vocab_size, self.seq_len, self.seed = size, vocab_size, seq_len, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        steps = torch.randint(1, 4, (self.seq_len,), generator=gen)
        start = torch.randint(0, self.vocab_size, (1,), generator=gen)
        # Ids 0 and 1 are reserved (padding, [MASK]).
        return (start + steps.cumsum(0)) % (self.vocab_size - 2) + 2


def preemption_args(hparams: dict) -> dict:
    """``watch_preemption`` keywords from the optional hyperparameter ``preemption_check_interval``:
    seconds between the ranks' checks (toolkit's default is 1 s; a shorter one stops sooner after
    a signal, for a tight grace period, at a small cost)."""
    interval = hparams.get("preemption_check_interval")
    return {} if interval is None else {"check_interval": interval}


def input_dtype(engine) -> torch.dtype:
    """The dtype of the engine's parameters (bf16 / fp16 when enabled): float inputs are cast to it,
    since DeepSpeed casts the model, not its inputs (fp16's ``auto_cast`` aside)."""
    if engine.bfloat16_enabled():
        return torch.bfloat16
    return torch.float16 if engine.fp16_enabled() else torch.float32


def make_loader(dataset: Dataset, *, num_replicas: int, rank: int, micro_batch: int, seed: int):
    """A DataLoader over this replica's share, resumable at any step (see toolkit.data)."""
    sampler = toolkit.ResumableDistributedSampler(dataset, num_replicas=num_replicas, rank=rank,
                                                  seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                        generator=sampler.loader_generator)
    return loader, sampler
