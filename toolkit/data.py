"""What an exact resume needs from the data side: the same order, from the same position. All ranks.

With :class:`ResumableDistributedSampler`, :func:`resume_position` and :func:`micro_batches` a run
restarted after ``steps_completed`` optimizer steps sees exactly the micro-batches the uninterrupted
run would have seen next. No collective: each rank its own share. Why each part: docs/exact-resume.md."""

from __future__ import annotations

import random
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from toolkit._checks import is_int
from toolkit.errors import ConfigError

__all__ = ["ResumableDistributedSampler", "ResumePosition", "batches_per_epoch", "micro_batches",
           "resume_position", "seed_everything"]

_SEED_LIMIT = 2**32  # numpy's legacy seeding accepts 0 <= seed < 2**32


def _check_count(name: str, value: object, *, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{name}={value!r}: expected a whole number >= {minimum}")
    return value


class ResumePosition(NamedTuple):
    """Where a run that completed ``steps_completed`` optimizer steps continues: the epoch (for
    ``set_epoch``) and the micro-batches of it each rank already consumed, also counted in samples."""

    epoch: int
    batches_to_skip: int
    samples_to_skip: int


def batches_per_epoch(samples_per_rank: int, *, micro_batch_size: int, drop_last: bool = False) -> int:
    """Micro-batches per epoch of one rank's DataLoader (``samples_per_rank``: ``sampler.num_samples``;
    ``drop_last``: the *DataLoader's*, True drops a last partial batch). Pure; any rank."""
    _check_count("samples_per_rank", samples_per_rank, minimum=0)
    _check_count("micro_batch_size", micro_batch_size, minimum=1)
    full, rest = divmod(samples_per_rank, micro_batch_size)
    return full if drop_last or not rest else full + 1


def resume_position(steps_completed: int, *, samples_per_rank: int, micro_batch_size: int,
                    gradient_accumulation_steps: int = 1, drop_last: bool = False,
                    carry_over: bool = True) -> ResumePosition:
    """Map optimizer steps completed to the epoch and the micro-batches to skip. Pure; any rank.

    Each step consumes ``gradient_accumulation_steps`` micro-batches per rank; skipped batches are whole.
    ``carry_over=True`` (default): micro-batches flow across epochs, so a step may mix two (a plain
    ``for epoch: for batch in loader`` loop, as DeepSpeed counts micro-steps across epochs, or a
    RepeatingLoader). False: each epoch ends with its last *full* step, the leftover batches unused.
    ConfigError for a count out of range, or an epoch without a batch (or a full step)."""
    _check_count("steps_completed", steps_completed, minimum=0)
    _check_count("gradient_accumulation_steps", gradient_accumulation_steps, minimum=1)
    batches = batches_per_epoch(samples_per_rank, micro_batch_size=micro_batch_size, drop_last=drop_last)
    if batches == 0:
        raise ConfigError(f"an epoch of samples_per_rank={samples_per_rank} with micro_batch_size="
                         f"{micro_batch_size} and drop_last=True holds no batch; use a smaller batch, "
                         "more data per rank, or drop_last=False")
    if carry_over:
        epoch, skip = divmod(steps_completed * gradient_accumulation_steps, batches)
    else:
        steps_per_epoch = batches // gradient_accumulation_steps
        if steps_per_epoch == 0:
            raise ConfigError(f"an epoch holds {batches} micro-batch(es), fewer than "
                             f"gradient_accumulation_steps={gradient_accumulation_steps}, so with "
                             "carry_over=False it holds no optimizer step; use carry_over=True, a smaller "
                             "batch or fewer accumulation steps")
        epoch, step_in_epoch = divmod(steps_completed, steps_per_epoch)
        skip = step_in_epoch * gradient_accumulation_steps
    return ResumePosition(epoch=epoch, batches_to_skip=skip, samples_to_skip=skip * micro_batch_size)


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way through. Call on all ranks.

    The order is upstream's; ``set_epoch(epoch, skip=n)`` starts the next iteration at this rank's
    ``n``-th sample. One ``seed`` on every rank; with pipeline or tensor parallelism pass the
    *data-parallel* size and rank. ``drop_last`` is the *sampler's* (drop the tail rather than pad).
    Pass :attr:`loader_generator` as the DataLoader's ``generator``: ``set_epoch`` seeds it from
    ``(seed, epoch)``, so ``iter(loader)`` leaves the global RNG alone. ``len(sampler)`` stays the
    whole epoch's share (``num_samples``) in a resumed epoch too (docs/exact-resume.md)."""

    def __init__(self, dataset: Any, *, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if not is_int(seed) or not 0 <= seed < 2**63:
            raise ConfigError(f"seed={seed!r}: expected a whole number in [0, 2**63)")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.skip = 0
        self.loader_generator = torch.Generator()
        self._seed_loader_generator()

    def _seed_loader_generator(self) -> None:
        # Distinct from the shuffle's seed + epoch; any fixed function of (seed, epoch) would do.
        self.loader_generator.manual_seed((self.seed * 1_000_003 + self.epoch + 1) % 2**63)

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        """Choose the next iteration's epoch and how many of this rank's samples of it to skip (0: from the
        start; a later call without ``skip`` resets it). Call on all ranks."""
        _check_count("epoch", epoch, minimum=0)
        _check_count("skip", skip, minimum=0)
        if skip > self.num_samples:
            raise ConfigError(f"skip={skip}: this rank's share of an epoch has only {self.num_samples} "
                             "samples; compute skip with sampler.resume_position(steps_completed, ...)")
        super().set_epoch(epoch)
        self.skip = skip
        self._seed_loader_generator()

    def resume_position(self, steps_completed: int, *, micro_batch_size: int,
                        gradient_accumulation_steps: int = 1, drop_last: bool = False,
                        carry_over: bool = True) -> ResumePosition:
        """:func:`resume_position` with this sampler's per-rank epoch length. Pure; any rank."""
        return resume_position(steps_completed, samples_per_rank=self.num_samples,
                               micro_batch_size=micro_batch_size,
                               gradient_accumulation_steps=gradient_accumulation_steps,
                               drop_last=drop_last, carry_over=carry_over)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

    def __len__(self) -> int:
        return self.num_samples  # the epoch's, not what is left of it: see the class docstring


def seed_everything(seed: int, *, deterministic: bool = False) -> None:
    """Seed Python's ``random``, numpy's global RNG and torch (CPU and every CUDA device). Call on all ranks.

    First thing, with the same seed (``[0, 2**32)``) on every rank, also when resuming
    (``load_checkpoint`` then restores each rank's streams). ``deterministic=True`` is for GPUs and
    costs speed: no cuDNN benchmark, deterministic kernels and algorithms (warn only). Why:
    docs/exact-resume.md."""
    if not is_int(seed) or not 0 <= seed < _SEED_LIMIT:
        raise ConfigError(f"seed={seed!r}: expected a whole number in [0, 2**32), numpy's limit")
    if not isinstance(deterministic, bool):
        raise ConfigError(f"deterministic={deterministic!r}: expected True or False")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # warn_only: ops without a deterministic kernel warn instead of failing a user's run.
        torch.use_deterministic_algorithms(True, warn_only=True)


def micro_batches(loader: DataLoader, sampler: ResumableDistributedSampler, *, steps_completed: int,
                  gradient_accumulation_steps: int = 1) -> Iterator[Any]:
    """The loader's micro-batches from where a run stopped after ``steps_completed`` steps, forever.

    Across epochs, from mid-epoch on a resume. Call on all ranks (each its own share; no collective).
    ``loader`` draws its order from ``sampler``; its ``batch_size`` and ``drop_last`` are read.

    Example (``torchrun --nproc_per_node 2 train.py``)::

        stream = toolkit.micro_batches(loader, sampler, steps_completed=steps_completed,
                                       gradient_accumulation_steps=grad_acc)
        batch = next(stream)
    """
    if not isinstance(sampler, ResumableDistributedSampler):
        raise TypeError(f"sampler={sampler!r}: expected the toolkit.ResumableDistributedSampler that the "
                        "loader draws from")
    if loader.batch_size is None:
        raise TypeError("loader.batch_size is None: micro_batches needs a DataLoader that batches "
                        "(DataLoader(dataset, batch_size=..., sampler=sampler))")
    start = sampler.resume_position(steps_completed, micro_batch_size=loader.batch_size,
                                    gradient_accumulation_steps=gradient_accumulation_steps,
                                    drop_last=loader.drop_last)
    epoch, skip = start.epoch, start.samples_to_skip
    while True:
        sampler.set_epoch(epoch, skip=skip)
        skip = 0
        yield from loader
        epoch += 1
