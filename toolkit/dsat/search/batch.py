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

When the best config's global batch differs from the one the user's config implies
(:func:`implied_global_batch`), :func:`global_batch_change` says so, by what factor, and with the
command that tunes within the user's batch: the closing lines and ``best_ds_metrics.json`` carry it.

Also here: the largest micro-batch whose predicted step time (on the line through the profiling
trials' step times) keeps a trial within ``--trial-timeout``.

Pure; any rank (the autotuner uses it on rank 0). Example::

    policy = global_batch_policy(None, user_train_batch_size=64)    # keep 64
    allowed_micro_batches(64, data_parallel_size=2)                  # (1, 2, 4, 8, 16, 32)
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from typing import Any, Mapping, Sequence

from toolkit._checks import int_problem, is_int, is_number
from toolkit.errors import ConfigError

__all__ = ["GLOBAL_BATCH_POLICIES", "BatchChange", "GlobalBatch", "allowed_micro_batches",
           "global_batch_change", "global_batch_policy", "implied_global_batch", "rerun_command",
           "step_time_line", "time_capped_micro_batch"]

GLOBAL_BATCH_POLICIES = ("keep", "fixed", "free")
TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


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

    def describe(self, implied: int | None = None) -> str:
        """One line for the console, e.g. ``global batch: keep train_batch_size=64 (the user's)``;
        ``implied``: the global batch the user's config implies (:func:`implied_global_batch`)."""
        if self.policy == "free":
            kept = (f"; your config implies {implied}, which --global-batch {implied} keeps"
                    if implied is not None else "")
            return ("global batch: free (train_batch_size = micro-batch x gradient_accumulation_steps x "
                    f"data-parallel size; the learning rate may need retuning{kept})")
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


def implied_global_batch(ds_config: Mapping[str, Any], *, data_parallel_size: int) -> int | None:
    """The global batch the user's DeepSpeed config implies, as DeepSpeed derives it: an integer
    ``train_batch_size``; else ``train_micro_batch_size_per_gpu x gradient_accumulation_steps``
    (1 when unset or "auto", as dsat's trials take it) ``x data_parallel_size``; None when
    neither batch key is a positive integer. Pure; any rank.

    Example:
        >>> implied_global_batch({"train_micro_batch_size_per_gpu": 8}, data_parallel_size=2)
        16
    """
    tbs, mbs, gas = (ds_config.get(k) for k in (TBS, MBS, GAS))
    if is_int(tbs) and tbs >= 1:
        return int(tbs)
    if not (is_int(mbs) and mbs >= 1):
        return None
    return int(mbs) * (int(gas) if is_int(gas) and gas >= 1 else 1) * data_parallel_size


def rerun_command(argv: Sequence[str], *, global_batch: str, output_dir: str) -> str:
    """The dsat command ``python -m toolkit.dsat ARGV`` as a new search with ``--global-batch``
    and ``--output-dir`` set (replacing the given ones, abbreviated or with ``=``) and
    ``--resume`` dropped; quoted for a POSIX shell. Pure; any rank.

    Example:
        >>> rerun_command(["binary", "d.yaml", ".", "--global-batch", "free"], global_batch="16",
        ...               output_dir="out-batch16")
        'python -m toolkit.dsat binary d.yaml . --global-batch 16 --output-dir out-batch16'
    """
    def flag(token: str) -> str | None:  # argparse takes any unambiguous prefix of a flag
        name = token.split("=", 1)[0]
        if len(name) < 3 or not name.startswith("--"):
            return None
        return next((f for f in ("--global-batch", "--output-dir", "--resume") if f.startswith(name)), None)

    kept, args = [], list(argv)
    while args:
        token = args.pop(0)
        which = flag(token)
        if which is None:
            kept.append(token)
        elif which != "--resume" and "=" not in token and args:
            args.pop(0)  # the flag's value
    kept += ["--global-batch", global_batch, "--output-dir", output_dir]
    return shlex.join(["python", "-m", "toolkit.dsat", *kept])


@dataclasses.dataclass(frozen=True)
class BatchChange:
    """The best config's global batch against the one the user's config implies.

    Attributes:
        policy: the policy the search ran with (:class:`GlobalBatch`'s, ``--global-batch``).
        user: the global batch the user's config implies (:func:`implied_global_batch`); None: none.
        best: the best config's ``train_batch_size``.
        micro_batch, accumulation, data_parallel_size: its factors.
        command: the dsat command that tunes within ``user`` (None when ``user`` is None).
    """

    policy: GlobalBatch
    user: int | None
    best: int
    micro_batch: int
    accumulation: int
    data_parallel_size: int
    command: str | None

    @property
    def changed(self) -> bool:
        """Whether the best config trains with another global batch than the user's config implies."""
        return self.user is not None and self.best != self.user

    @property
    def factor(self) -> float | None:
        """``best / user``: how many times the samples per step; None when the config implies none."""
        return None if self.user is None else self.best / self.user

    def notice(self) -> str | None:
        """One line for the closing lines when the global batch is not the user's; None when it is."""
        if not self.changed and self.user is not None:
            return None
        flag = "--global-batch " + (self.policy.policy if self.policy.policy == "free" else str(self.best))
        how = (f"{self.best} = micro-batch {self.micro_batch} x gradient_accumulation_steps "
               f"{self.accumulation} x data-parallel size {self.data_parallel_size}, {flag}")
        if self.user is None:
            return (f"global batch: the best config trains with train_batch_size {how}; your DeepSpeed "
                    "config implies none (no integer train_batch_size or train_micro_batch_size_per_gpu)")
        return (f"global batch changed from {self.user} to {self.best} samples per step "
                f"({self.factor:.3g}x; {how}; {self.user} is what your DeepSpeed config implies), with "
                f"your learning rate unchanged. To tune within {self.user}: {self.command}")

    def to_json(self) -> dict[str, Any]:
        """What ``best_ds_metrics.json``'s ``global_batch`` adds to the policy and the best's batch keys."""
        return {"user_train_batch_size": self.user, "factor": self.factor, "changed": self.changed,
                "notice": self.notice(), "command": self.command if self.changed else None}


def global_batch_change(user_ds_config: Mapping[str, Any], best_ds_config: Mapping[str, Any], *,
                        policy: GlobalBatch, data_parallel_size: int, argv: Sequence[str],
                        output_dir: str) -> BatchChange:
    """How the best config's global batch compares with the user's (see :class:`BatchChange`).

    ``argv``: the search's dsat arguments (after ``python -m toolkit.dsat``), from which the
    command tuning within the user's batch is made: ``--global-batch keep`` when the user's
    config sets an integer ``train_batch_size``, else ``--global-batch N``, and the output
    directory ``OUTPUT_DIR-batchN`` (a new search). Pure; any rank.

    Example:
        >>> change = global_batch_change({MBS: 8}, {TBS: 1090, MBS: 545, GAS: 1}, policy=GlobalBatch("free"),
        ...                              data_parallel_size=2, argv=["binary", "d.yaml", "."], output_dir="o")
        >>> change.user, change.best, change.changed
        (16, 1090, True)
    """
    user = implied_global_batch(user_ds_config, data_parallel_size=data_parallel_size)
    command = None
    if user is not None:
        tbs = user_ds_config.get(TBS)
        keep = "keep" if is_int(tbs) and tbs >= 1 else str(user)
        command = rerun_command(argv, global_batch=keep, output_dir=f"{output_dir}-batch{user}")
    return BatchChange(policy, user, int(best_ds_config[TBS]), int(best_ds_config[MBS]),
                       int(best_ds_config.get(GAS, 1)), data_parallel_size, command)


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
