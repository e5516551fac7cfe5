"""What an exact resume needs from the data side: the same order, from the same position.

A run restarted from its checkpoint after ``steps_completed`` optimizer steps must see exactly
the micro-batches the uninterrupted run would have seen next; :class:`ResumableDistributedSampler`,
:func:`resume_position` and :func:`micro_batches` give it that. Call on all ranks (no collective;
each rank iterates its own share). Why each part is needed: docs/exact-resume.md.

Example::

    # torchrun --nproc_per_node 2 train.py
    toolkit.seed_everything(seed)                            # call on all ranks, same seed
    sampler = toolkit.ResumableDistributedSampler(dataset, num_replicas=ctx.world_size,
                                                  rank=ctx.rank, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                        generator=sampler.loader_generator)
    stream = toolkit.micro_batches(loader, sampler, steps_completed=steps_completed,
                                   gradient_accumulation_steps=grad_acc)
"""

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
    """Where a run that completed ``steps_completed`` optimizer steps continues.

    Attributes:
        epoch: the epoch to start in (pass to ``sampler.set_epoch``).
        batches_to_skip: micro-batches of that epoch already consumed on each rank.
        samples_to_skip: the same in samples (``batches_to_skip * micro_batch_size``), which is
            what ``ResumableDistributedSampler.set_epoch(epoch, skip=...)`` takes.
    """

    epoch: int
    batches_to_skip: int
    samples_to_skip: int


def batches_per_epoch(samples_per_rank: int, *, micro_batch_size: int, drop_last: bool = False) -> int:
    """Micro-batches one rank's DataLoader yields per epoch. Pure; any rank.

    Args:
        samples_per_rank: ``sampler.num_samples`` (the per-rank epoch length, after the
            sampler's own padding or dropping).
        micro_batch_size: the DataLoader's ``batch_size``.
        drop_last: the *DataLoader's* ``drop_last``: True drops a last partial batch, False
            yields it as a smaller batch.
    """
    _check_count("samples_per_rank", samples_per_rank, minimum=0)
    _check_count("micro_batch_size", micro_batch_size, minimum=1)
    full, rest = divmod(samples_per_rank, micro_batch_size)
    return full if drop_last or not rest else full + 1


def resume_position(steps_completed: int, *, samples_per_rank: int, micro_batch_size: int,
                    gradient_accumulation_steps: int = 1, drop_last: bool = False,
                    carry_over: bool = True) -> ResumePosition:
    """Map optimizer steps completed to the epoch and micro-batches to skip. Pure; any rank.

    Each optimizer step consumes ``gradient_accumulation_steps`` micro-batches on every rank.
    Skipped batches are always whole ones: the only partial batch is the last of an epoch, and a
    position never points past it.

    Args:
        steps_completed: optimizer steps done (``engine.global_steps``, or what
            ``toolkit.load_checkpoint`` returned).
        samples_per_rank: ``sampler.num_samples``.
        micro_batch_size: the DataLoader's ``batch_size``.
        gradient_accumulation_steps: micro-batches per optimizer step.
        drop_last: the DataLoader's ``drop_last`` (see :func:`batches_per_epoch`).
        carry_over: True (default) when micro-batches flow across epoch boundaries, so an
            optimizer step may mix the end of one epoch with the start of the next: what a
            ``for epoch: for batch in loader: engine.backward(); engine.step()`` loop does, since
            DeepSpeed counts micro-steps across epochs, and what a RepeatingLoader feeding
            ``train_batch`` does. False when each epoch ends with its last *full* optimizer step
            and the ``batches % gradient_accumulation_steps`` leftover micro-batches are not used.

    Returns:
        A :class:`ResumePosition`.

    Raises:
        ConfigError: a count is negative or zero where it cannot be, or an epoch holds no batch
            (or, with ``carry_over=False``, no full optimizer step).

    Example:
        >>> resume_position(7, samples_per_rank=50, micro_batch_size=4, gradient_accumulation_steps=2)
        ResumePosition(epoch=1, batches_to_skip=1, samples_to_skip=4)
    """
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

    The order of an epoch is upstream's; ``set_epoch(epoch, skip=n)`` makes the next iteration
    start at this rank's ``n``-th sample of it (docs/exact-resume.md). Use the same ``seed`` on
    every rank; with pipeline or tensor parallelism pass the *data-parallel* size and rank.

    Args:
        dataset: a sized dataset.
        num_replicas: data-parallel size; default: the world size of torch.distributed.
        rank: data-parallel rank; default: the rank in torch.distributed.
        shuffle: shuffle each epoch.
        seed: base seed of the shuffle and of :attr:`loader_generator`.
        drop_last: the *sampler's* ``drop_last``: drop the tail so every rank gets the same number
            of distinct samples, instead of padding with repeated ones.

    Attributes:
        loader_generator: a ``torch.Generator`` for the DataLoader's ``generator`` argument;
            ``set_epoch`` seeds it from ``(seed, epoch)``, so ``iter(loader)`` neither touches the
            global RNG nor depends on where the run was resumed.
        skip: samples of the current epoch this rank skips.

    ``len(sampler)`` (and so ``len(loader)``) is the whole epoch's share, ``num_samples``, also
    while a resumed epoch yields only the ``len(sampler) - skip`` samples after ``skip``: read it
    for epochs, schedule lengths and step labels at any time (DeepSpeed-Chat does).

    Example::

        # torchrun --nproc_per_node 2 train.py
        sampler = ResumableDistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler, generator=sampler.loader_generator)
        start = sampler.resume_position(steps_completed, micro_batch_size=8)
        sampler.set_epoch(start.epoch, skip=start.samples_to_skip)
    """

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
        """Choose the next iteration's epoch and how many of this rank's samples to skip. Call on all ranks.

        Args:
            epoch: the epoch (its order is a function of ``seed + epoch``).
            skip: samples of this rank's share of ``epoch`` already consumed; 0 starts the epoch
                from its beginning. A later ``set_epoch`` without ``skip`` resets it to 0.
        """
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

    Call it once, first thing, with the same seed on every rank, so that every rank builds the
    same initial weights; a resumed run still calls it (``toolkit.load_checkpoint`` then restores
    each rank's RNG states). On CPU an exact resume needs nothing more; ``deterministic=True`` is
    for GPUs and costs speed (why: docs/exact-resume.md).

    Args:
        seed: a whole number in ``[0, 2**32)`` (numpy's limit).
        deterministic: on GPUs, trade speed for bitwise-reproducible kernels: cuDNN's benchmark
            mode off, deterministic cuDNN kernels, torch's deterministic algorithms (warn only).

    Example::

        # torchrun --nproc_per_node 2 train.py
        toolkit.seed_everything(hparams["seed"], deterministic=True)
    """
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

    Across epochs (``sampler.set_epoch`` at each), starting mid-epoch on a resume, so that a run
    resumed from a checkpoint sees exactly the micro-batches the uninterrupted run would have
    seen next. Call on all ranks (each rank iterates its own share; no collective). ``loader``
    must take its order from ``sampler`` (``DataLoader(..., sampler=sampler)``) and its
    ``batch_size`` and ``drop_last`` are read from it.

    Example::

        # torchrun --nproc_per_node 2 train.py
        sampler = toolkit.ResumableDistributedSampler(dataset, num_replicas=ctx.world_size,
                                                      rank=ctx.rank, seed=seed, drop_last=True)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True,
                            generator=sampler.loader_generator)
        stream = toolkit.micro_batches(loader, sampler, steps_completed=steps_completed,
                                       gradient_accumulation_steps=grad_acc)
        for _ in range(grad_acc):
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
