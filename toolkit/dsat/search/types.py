"""The search's vocabulary: trials to run (:class:`TrialSpec`), their results, the settings, the
:class:`Searcher` protocol. Pure values; any rank (built on rank 0, a trial reads its spec).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Protocol, Sequence

from toolkit._checks import int_problem, is_int, is_number
from toolkit.dsat.contract import METRICS, TrialStatus
from toolkit.errors import ConfigError

__all__ = [
    "OFFLOAD_MODES",
    "SEARCH_METHODS",
    "SMALLER_IS_BETTER",
    "SearchSettings",
    "Searcher",
    "TrialResult",
    "TrialSpec",
    "is_better",
]

SEARCH_METHODS = ("binary", "random", "asha")
OFFLOAD_MODES = ("auto", "never", "always")  # see toolkit.dsat.search.offload
SMALLER_IS_BETTER = frozenset({"forward", "backward", "latency"})


def is_better(metric: str, candidate: float, incumbent: float | None) -> bool:
    """``candidate`` beats ``incumbent`` for ``metric``; a non-finite candidate beats nothing, a None or
    non-finite incumbent loses to any finite one. Pure; any rank."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}: expected one of {', '.join(METRICS)}")
    if not math.isfinite(candidate):
        return False
    if incumbent is None or not math.isfinite(incumbent):
        return True
    return candidate < incumbent if metric in SMALLER_IS_BETTER else candidate > incumbent


@dataclasses.dataclass(frozen=True)
class TrialSpec:
    """One trial: a micro-batch and ZeRO section over the user's config. Profiling trials: ``profile``,
    line -1, ids 0 and below; ``label``, ``rerun`` and ``baseline`` are the orchestrator's."""

    trial_id: int                           # unique, stable across a resume; 0 and below: profiling
    micro_batch: int
    zero: Mapping[str, Any]                 # the zero_optimization section, merged over the user's
    line: int = -1                          # the search line; -1 for profiling trials
    profile: bool = False
    label: str = ""                         # p1, p2, ... for profiling trials; empty: the id
    rerun: bool = False                     # a confirmation re-run, after the search
    baseline: bool = False                  # the user's own config as written ("own")

    @property
    def stage(self) -> int:
        return int(self.zero.get("stage", 0))

    @property
    def name(self) -> str:
        """The trial as the user sees it: its label (profiling trials: ``p1``, ...), else its id."""
        return self.label or str(self.trial_id)

    def ds_overrides(self) -> dict[str, Any]:
        """What to merge over the user's DeepSpeed config for this trial."""
        return {"train_micro_batch_size_per_gpu": self.micro_batch,
                "zero_optimization": json.loads(json.dumps(dict(self.zero)))}

    def to_json(self) -> dict[str, Any]:
        extra = {**({"label": self.label} if self.label else {}), **({"rerun": True} if self.rerun else {}),
                 **({"baseline": True} if self.baseline else {})}
        return {"trial_id": self.trial_id, "micro_batch": self.micro_batch,
                "zero": json.loads(json.dumps(dict(self.zero))), "line": self.line,
                "profile": self.profile, **extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TrialSpec":
        return cls(int(data["trial_id"]), int(data["micro_batch"]), dict(data["zero"]),
                   int(data.get("line", -1)), bool(data.get("profile", False)),
                   str(data.get("label") or ""), bool(data.get("rerun", False)),
                   bool(data.get("baseline", False)))


@dataclasses.dataclass(frozen=True)
class TrialResult:
    """What came of a trial: its status, the five metrics when OK, ``error`` in words otherwise, a
    profiling trial's profile, the largest rank peak the runner saw (``peak_bytes``; None: unknown)."""

    spec: TrialSpec
    status: TrialStatus
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)  # the five METRICS if OK
    duration_s: float = 0.0                 # wall time of the trial's processes
    error: str | None = None                # why not OK, in words; logs in the trial's directory
    profile: Mapping[str, Any] | None = None  # a profiling trial's ProfileInfo
    peak_bytes: int | None = None           # on CPU peak RSS, on GPUs the chief's peak
    data_limit: int | None = None           # failed: the most examples per forward the script's data gave

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec.to_json(), "status": self.status.value, "metrics": dict(self.metrics),
                "duration_s": self.duration_s, "error": self.error,
                "profile": dict(self.profile) if self.profile is not None else None,
                **({"peak_bytes": self.peak_bytes} if self.peak_bytes is not None else {}),
                **({"data_limit": self.data_limit} if self.data_limit is not None else {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TrialResult":
        peak, limit = data.get("peak_bytes"), data.get("data_limit")
        return cls(TrialSpec.from_json(data["spec"]), TrialStatus(data["status"]),
                   dict(data.get("metrics") or {}), float(data.get("duration_s", 0.0)),
                   data.get("error"), data.get("profile"), int(peak) if peak is not None else None,
                   int(limit) if limit is not None else None)


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """Everything a search method needs besides the profile; validated on construction, all problems in
    one :class:`ConfigError`, each naming dsat's flag (or the config key) that sets the field. The
    fields: docs/design-dsat-search.md#the-searcher-protocol."""

    method: str
    metric: str = "FLOPS_per_gpu"
    max_trials: int = 50                    # counts the first profiling trial: max_trials - 1 proposed
    zero_stages: tuple[int, ...] = (1, 2, 3)
    data_parallel_size: int = 1             # slots per trial (S in the memory model)
    random_seed: int = 42                   # seeds the searcher's own random.Random only
    base_zero: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the user's ZeRO section
    trials_per_random_config: int = 5       # random
    early_stopping: int | None = None       # random
    search_range_factor: float = 1.0        # binary, asha: lines on [1, factor x the model's max]
    bisect_tolerance: float = 0.25          # binary: stop once hi - f <= tolerance x f
    max_rungs: int = 5                      # asha, as the next three
    min_binary_search_trials: int = 3
    asha_early_stopping: int = 0
    divisor: int = 2
    micro_batches: tuple[int, ...] | None = None  # the only ones a trial may use; None: any
    max_micro_batch: int | None = None      # none above (the trial timeout); None: no cap
    offload: str = "auto"                   # OFFLOAD_MODES

    def __post_init__(self) -> None:
        p: list[str | None] = []
        if self.method not in SEARCH_METHODS:
            p.append(f"method={self.method!r}: expected one of {', '.join(SEARCH_METHODS)}")
        if self.metric not in METRICS:
            p.append(f"metric={self.metric!r}: expected one of {', '.join(METRICS)}")
        if not self.zero_stages or not all(is_int(s) and 0 <= s <= 3 for s in self.zero_stages):
            p.append(f"--zero-stages={self.zero_stages!r}: expected one or more of 0, 1, 2, 3")
        if self.early_stopping is not None:
            p.append(int_problem("--early-stopping", self.early_stopping, minimum=1, hint=" or None"))
        if not is_number(self.search_range_factor) or not self.search_range_factor > 0:
            p.append(f"--search-range-factor={self.search_range_factor!r}: expected a number > 0")
        if not is_number(self.bisect_tolerance) or not 0 <= self.bisect_tolerance < 1:
            p.append(f"--bisect-tolerance={self.bisect_tolerance!r}: expected a number >= 0 and < 1 (0 "
                     "bisects the micro-batch range exactly, 0.25 stops within 25% of the largest fitting "
                     "micro-batch)")
        p += [int_problem("--max-trials", self.max_trials, minimum=2,
                          hint=" (it counts the profiling trial)"),
              int_problem("hyperparameters.data_parallel_world_size", self.data_parallel_size, minimum=1),
              int_problem("--trials-per-random-config", self.trials_per_random_config, minimum=1),
              int_problem("--max-rungs", self.max_rungs, minimum=1),
              int_problem("--min-binary-search-trials", self.min_binary_search_trials, minimum=1),
              int_problem("--asha-early-stopping", self.asha_early_stopping, minimum=0),
              int_problem("--divisor", self.divisor, minimum=2)]
        p += self._micro_batch_problems()
        problems = [problem for problem in p if problem]
        if problems:
            raise ConfigError(problems)


    def _micro_batch_problems(self) -> list[str | None]:
        """The allowed micro-batches (ascending, 1 first), the cap, the offload mode."""
        p: list[str | None] = []
        mbs = self.micro_batches
        if mbs is not None and (not isinstance(mbs, tuple) or not mbs or not all(is_int(m) for m in mbs)
                                or mbs[0] != 1 or list(mbs) != sorted(set(mbs))):
            p.append(f"micro_batches={mbs!r}: expected a tuple of ascending integers starting at 1, or None")
        if self.max_micro_batch is not None:
            p.append(int_problem("max_micro_batch", self.max_micro_batch, minimum=1, hint=" or None"))
        if self.offload not in OFFLOAD_MODES:
            p.append(f"--offload={self.offload!r}: expected one of {', '.join(OFFLOAD_MODES)}")
        elif self.offload == "always" and all(is_int(x) for x in self.zero_stages) \
                and not set(self.zero_stages) & {2, 3}:
            p.append(f"--offload=always with --zero-stages={list(self.zero_stages)}: offload needs stage 2 "
                     "or 3; add one to --zero-stages or use --offload auto")
        return p


class Searcher(Protocol):
    """A search method: pure and deterministic for a seed and call order, so that replaying the recorded
    results rebuilds it (``--resume``). Rank 0 only by use."""

    def propose(self, capacity: int) -> list[TrialSpec]:
        """Up to ``capacity`` new trials to start now (may be fewer, or none while waiting)."""
        ...

    def observe(self, result: TrialResult) -> None:
        """Take a finished trial's result into account."""
        ...

    def observe_profiling(self, results: Sequence[TrialResult]) -> list[TrialResult]:
        """Before the first propose: take the profiling trials at its configurations; those taken."""
        ...

    @property
    def done(self) -> bool:
        """No trial is running or will be proposed."""
        ...

    @property
    def in_flight(self) -> list[TrialSpec]:
        """Trials proposed and not yet observed, by id."""
        ...

    @property
    def observed_count(self) -> int:
        """Results observed so far (recorded with each proposed trial, for the replay)."""
        ...

    @property
    def budget_left(self) -> int:
        """Trials it may still propose."""
        ...

    @property
    def notes(self) -> list[str]:
        """What the user should read, in order (conflicting verdicts and their repeat)."""
        ...

    @property
    def best(self) -> TrialResult | None:
        """The best successful result observed so far, or None."""
        ...
