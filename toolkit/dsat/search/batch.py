"""The global batch policy (``--global-batch``), the micro-batches that keep it, and the cap that
keeps a trial within ``--trial-timeout``.

Pure; any rank (the autotuner uses it on rank 0). Design: docs/design-dsat-search.md.
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
    """The global batch policy in force: ``keep`` (the user's ``train_batch_size``), ``fixed``
    (``--global-batch N``) or ``free`` (no ``train_batch_size``). Validated on construction."""

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
    """The policy of ``--global-batch`` (None, not given: the user's integer kept, else free);
    ``keep`` without an integer in the config is a :class:`ConfigError`. Pure; any rank."""
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
    """The global batch the user's config implies, as DeepSpeed derives it: ``train_batch_size``, else
    micro-batch x accumulation (1 if unset or "auto") x ``data_parallel_size``; None if neither is set.
    Pure; any rank."""
    tbs, mbs, gas = (ds_config.get(k) for k in (TBS, MBS, GAS))
    if is_int(tbs) and tbs >= 1:
        return int(tbs)
    if not (is_int(mbs) and mbs >= 1):
        return None
    return int(mbs) * (int(gas) if is_int(gas) and gas >= 1 else 1) * data_parallel_size


def rerun_command(argv: Sequence[str], *, global_batch: str, output_dir: str) -> str:
    """``python -m toolkit.dsat ARGV`` as a new search: ``--global-batch`` and ``--output-dir`` replaced
    (abbreviated or with ``=`` too), ``--resume`` dropped, quoted for a POSIX shell. Pure; any rank."""
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
    """The best config's global batch (``best`` and its factors) against the one the user's config implies
    (``user``; None: none), with the dsat ``command`` that tunes within ``user``."""

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
    """How the best config's global batch compares with the user's. ``argv``: the search's dsat
    arguments, made into the command that keeps the user's batch (in ``OUTPUT_DIR-batchN``).
    Pure; any rank."""
    user = implied_global_batch(user_ds_config, data_parallel_size=data_parallel_size)
    command = None
    if user is not None:
        tbs = user_ds_config.get(TBS)
        keep = "keep" if is_int(tbs) and tbs >= 1 else str(user)
        command = rerun_command(argv, global_batch=keep, output_dir=f"{output_dir}-batch{user}")
    return BatchChange(policy, user, int(best_ds_config[TBS]), int(best_ds_config[MBS]),
                       int(best_ds_config.get(GAS, 1)), data_parallel_size, command)


def allowed_micro_batches(train_batch_size: int, *, data_parallel_size: int) -> tuple[int, ...]:
    """The divisors of ``train_batch_size / data_parallel_size``, ascending; :class:`ConfigError`
    when ``train_batch_size`` is not a multiple of ``data_parallel_size``. Pure; any rank."""
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
    """The profiling trials' step-time line ``(m0, t0, ms per example)`` from their ``(micro_batch, ms)``:
    from the smallest, the steepest slope to a larger one (without one: through the origin); None if
    nothing usable. Pure; any rank."""
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
    """The largest micro-batch whose trial, ``overhead_s + steps x step(m)`` with
    ``step(m) = latency_ms + per_example_ms x (m - micro_batch)`` (None: in proportion), ends within
    ``timeout_s``; at least ``micro_batch``; None: no cap. Pure; any rank."""
    if not is_number(latency_ms) or latency_ms <= 0 or not math.isfinite(latency_ms):
        return None
    slope = latency_ms / max(micro_batch, 1) if per_example_ms is None else per_example_ms
    if not is_number(slope) or slope <= 0 or not math.isfinite(slope):
        return None
    room_ms = (timeout_s - max(overhead_s, 0.0)) * 1000.0 / max(steps, 1)
    return max(micro_batch + int((room_ms - latency_ms) // slope), micro_batch, 1)
