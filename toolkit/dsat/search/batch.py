"""The global batch policy, and which micro-batches a trial may use.

A real run fixes its global batch (``train_batch_size``: the learning rate was tuned for it), so
by default dsat keeps the user's: it searches the micro-batches ``m`` that divide
``train_batch_size / data_parallel_size`` and derives ``gradient_accumulation_steps`` so that
``m x accumulation x data_parallel_size = train_batch_size`` exactly. The policies
(``--global-batch``):

* ``keep``: the user's integer ``train_batch_size`` (the default when the config sets one);
* ``N`` (``fixed``): ``train_batch_size = N``, whatever the config says;
* ``free``: Determined's behaviour, ``train_batch_size = micro-batch x accumulation x
  data_parallel_size`` with the user's accumulation (the default when the config sets none).

Also here: the largest micro-batch whose predicted step time (on the line through the profiling
trials' step times) keeps a trial within ``--trial-timeout``.

Pure; any rank (the autotuner uses it on rank 0). Example::

    policy = global_batch_policy(None, user_train_batch_size=64)    # keep 64
    allowed_micro_batches(64, data_parallel_size=2)                  # (1, 2, 4, 8, 16, 32)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from toolkit._checks import int_problem, is_int, is_number
from toolkit.errors import ConfigError

__all__ = ["GLOBAL_BATCH_POLICIES", "GlobalBatch", "allowed_micro_batches", "global_batch_policy",
           "step_time_line", "time_capped_micro_batch"]

GLOBAL_BATCH_POLICIES = ("keep", "fixed", "free")
TBS = "train_batch_size"


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """The global batch policy in force. Validated on construction.

    Attributes:
        policy: ``"keep"`` (the user's ``train_batch_size``), ``"fixed"`` (``--global-batch N``)
            or ``"free"`` (micro-batch x accumulation x data-parallel size).
        train_batch_size: the global batch every trial keeps; None for ``"free"``.
    """

    policy: str
    train_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in GLOBAL_BATCH_POLICIES:
            raise ConfigError(f"global batch policy={self.policy!r}: expected one of "
                              f"{', '.join(GLOBAL_BATCH_POLICIES)}")
        if self.policy == "free" and self.train_batch_size is not None:
            raise ConfigError(f"global batch policy 'free' with train_batch_size={self.train_batch_size}: "
                              "a free policy fixes no global batch")
        if self.policy != "free":
            problem = int_problem(TBS, self.train_batch_size, minimum=1)
            if problem:
                raise ConfigError(problem)

    def describe(self) -> str:
        """One line for the console, e.g. ``global batch: keep train_batch_size=64 (the user's)``."""
        if self.policy == "free":
            return ("global batch: free (train_batch_size = micro-batch x gradient_accumulation_steps x "
                    "data-parallel size; the learning rate may need retuning)")
        why = "the user's" if self.policy == "keep" else "--global-batch"
        return (f"global batch: {self.policy} train_batch_size={self.train_batch_size} ({why}); "
                "gradient_accumulation_steps derived for each micro-batch")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def global_batch_policy(flag: str | int | None, *, user_train_batch_size: Any) -> GlobalBatch:
    """The policy of ``--global-batch`` (None: not given) for the user's ``train_batch_size``.

    Not given: keep the user's positive integer, else free (a bad value is the config check's to
    report). ``"keep"`` with no integer in the config is a :class:`ConfigError`. Pure; any rank.

    Example:
        >>> global_batch_policy(None, user_train_batch_size="auto").policy
        'free'
    """
    user = None
    if is_int(user_train_batch_size) and user_train_batch_size >= 1:
        user = int(user_train_batch_size)
    if flag is None:
        return GlobalBatch("keep", user) if user is not None else GlobalBatch("free")
    if flag == "free":
        return GlobalBatch("free")
    if flag == "keep":
        if user is None:
            raise ConfigError(f"--global-batch keep: the DeepSpeed config's {TBS} is "
                              f"{user_train_batch_size!r}, not an integer to keep; set it in the JSON or "
                              "overwrite_deepspeed_args, pass --global-batch N, or --global-batch free")
        return GlobalBatch("keep", user)
    if is_int(flag) and flag >= 1:
        return GlobalBatch("fixed", int(flag))
    raise ConfigError(f"--global-batch {flag!r}: expected keep, free or a positive integer")


def allowed_micro_batches(train_batch_size: int, *, data_parallel_size: int) -> tuple[int, ...]:
    """The micro-batches that keep ``train_batch_size``: the divisors of ``train_batch_size /
    data_parallel_size``, ascending. Pure; any rank.

    Raises:
        ConfigError: ``train_batch_size`` is not a multiple of ``data_parallel_size`` (no
            micro-batch can keep it).

    Example:
        >>> allowed_micro_batches(24, data_parallel_size=2)
        (1, 2, 3, 4, 6, 12)
    """
    if train_batch_size % data_parallel_size:
        raise ConfigError(f"{TBS}={train_batch_size} is not a multiple of the data-parallel size "
                          f"{data_parallel_size}: no micro-batch x gradient_accumulation_steps x "
                          f"{data_parallel_size} equals it; set {TBS} (or --global-batch) to a multiple of "
                          f"{data_parallel_size}, e.g. "
                          f"{max(train_batch_size // data_parallel_size, 1) * data_parallel_size}")
    per_rank = train_batch_size // data_parallel_size
    small = [d for d in range(1, math.isqrt(per_rank) + 1) if per_rank % d == 0]
    return tuple(sorted(set(small + [per_rank // d for d in small])))


def step_time_line(measured: list[tuple[int, float]]) -> tuple[int, float, float] | None:
    """The step time's line for :func:`time_capped_micro_batch`, from profiling trials'
    ``(micro_batch, step ms)``: ``(m0, t0, ms per example)`` anchored at the smallest micro-batch
    measured, with the steepest slope from it to any larger one (stages differ: the slowest
    bounds them all). Through the origin, ``t0 / m0`` per example, when only one micro-batch was
    measured or no slope is positive. A step's fixed cost (launch, communication, the optimizer)
    makes micro-batch 1 cost several times its share, so scaling it alone caps the micro-batch far
    below what the timeout allows. None when nothing usable was measured. Pure; any rank.

    Example:
        >>> step_time_line([(1, 24.0), (125, 148.0), (1397, 1420.0)])   # 1 ms per example beyond 1
        (1, 24.0, 1.0)
        >>> step_time_line([(1, 24.0)])
        (1, 24.0, 24.0)
    """
    usable = sorted((int(m), float(t)) for m, t in measured
                    if is_int(m) and int(m) >= 1 and is_number(t) and math.isfinite(t) and t > 0)
    if not usable:
        return None
    m0, t0 = usable[0]
    slopes = [(t - t0) / (m - m0) for m, t in usable[1:] if m > m0 and t > t0]
    return m0, t0, max(slopes) if slopes else t0 / m0


def time_capped_micro_batch(latency_ms: float, *, steps: int, timeout_s: float,
                            overhead_s: float = 0.0, micro_batch: int = 1,
                            per_example_ms: float | None = None) -> int | None:
    """The largest micro-batch whose trial is predicted to end within ``timeout_s``; None: no cap.

    A trial at micro-batch ``m`` is predicted to take ``overhead_s + steps x step(m) / 1000``,
    where ``step(m) = latency_ms + per_example_ms x (m - micro_batch)``: the line through the
    profiling trials' step times (:func:`step_time_line`). Without ``per_example_ms`` the
    latency scales in proportion to the micro-batch (an upper bound when the global batch is
    kept). At least ``micro_batch`` (a profiling trial ran it). Pure; any rank.

    Example:
        >>> time_capped_micro_batch(100.0, steps=5, timeout_s=60.0, overhead_s=10.0)
        100
        >>> time_capped_micro_batch(100.0, steps=5, timeout_s=60.0, overhead_s=10.0, per_example_ms=1.0)
        9901
    """
    if not is_number(latency_ms) or latency_ms <= 0 or not math.isfinite(latency_ms):
        return None
    slope = latency_ms / max(micro_batch, 1) if per_example_ms is None else per_example_ms
    if not is_number(slope) or slope <= 0 or not math.isfinite(slope):
        return None
    room_ms = (timeout_s - max(overhead_s, 0.0)) * 1000.0 / max(steps, 1)
    return max(micro_batch + int((room_ms - latency_ms) // slope), micro_batch, 1)
