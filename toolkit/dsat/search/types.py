"""The vocabulary of the search: trials to run, their results, the search settings, the
:class:`Searcher` protocol.

Search methods are pure: they see :class:`TrialResult` objects and return the next
:class:`TrialSpec` objects; the runner (:mod:`toolkit.dsat.execution.runner`) turns a spec into real
processes and a result. Pure values; any rank (the tuner builds them on rank 0, a trial reads
its spec). Example::

    spec = TrialSpec(trial_id=3, micro_batch=16, zero={"stage": 2}, line=1)
    overrides = spec.ds_overrides()   # merged over the user's DeepSpeed config for trial 3
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
    """True when ``candidate`` beats ``incumbent`` for ``metric``. Pure; any process.

    A candidate that is not a finite number (NaN, infinity) beats nothing; None, NaN or an
    infinite incumbent is beaten by any finite candidate.
    """
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}: expected one of {', '.join(METRICS)}")
    if not math.isfinite(candidate):
        return False
    if incumbent is None or not math.isfinite(incumbent):
        return True
    return candidate < incumbent if metric in SMALLER_IS_BETTER else candidate > incumbent


@dataclasses.dataclass(frozen=True)
class TrialSpec:
    """One trial to run: a DeepSpeed config override on top of the user's config.

    Attributes:
        trial_id: unique and stable within a search (0 is the profiling trial); a resumed
            search regenerates the same ids for the same trials.
        micro_batch: ``train_micro_batch_size_per_gpu``.
        zero: the ``zero_optimization`` section to use (merged over the user's).
        line: the search line (one random ZeRO config explored by bisection); -1 for profiling.
        profile: a profiling trial (the memory model's measurements; 0 the first, at micro-batch 1,
            the others below 0).
        label: what the user sees for a profiling trial (``p1``, ``p2``, ... in the order they
            ran; the orchestrator sets it); empty: the trial id.
        rerun: a re-run of a configuration already measured, to confirm the best (the
            orchestrator's, after the search; no searcher proposed it).
        baseline: the user's own config as written, measured after the search when no trial
            did (the orchestrator's; labelled ``own``), to compare the best with.
    """

    trial_id: int
    micro_batch: int
    zero: Mapping[str, Any]
    line: int = -1
    profile: bool = False
    label: str = ""
    rerun: bool = False
    baseline: bool = False

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
    """What came of a trial.

    Attributes:
        spec: the trial.
        status: how it ended.
        metrics: the five :data:`METRICS` when ``status`` is OK, else empty.
        duration_s: wall time of the trial's processes.
        error: a short human-readable reason for a non-OK status (exit code, signal, what was
            missing); the trial's own logs are in its directory.
        profile: for the profiling trial, its :class:`ProfileInfo` as a dict.
        peak_bytes: the largest peak memory of a rank the runner saw (on CPU the ranks' peak
            resident size, what the budget is held against; on GPUs the chief's reported peak);
            None: not measured (a record older than this field).
    """

    spec: TrialSpec
    status: TrialStatus
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    duration_s: float = 0.0
    error: str | None = None
    profile: Mapping[str, Any] | None = None
    peak_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec.to_json(), "status": self.status.value, "metrics": dict(self.metrics),
                "duration_s": self.duration_s, "error": self.error,
                "profile": dict(self.profile) if self.profile is not None else None,
                **({"peak_bytes": self.peak_bytes} if self.peak_bytes is not None else {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TrialResult":
        peak = data.get("peak_bytes")
        return cls(TrialSpec.from_json(data["spec"]), TrialStatus(data["status"]),
                   dict(data.get("metrics") or {}), float(data.get("duration_s", 0.0)),
                   data.get("error"), data.get("profile"), int(peak) if peak is not None else None)


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """Everything a search method needs besides the profile. Validated on construction.

    Attributes:
        method: one of :data:`SEARCH_METHODS`.
        metric: one of :data:`METRICS`.
        max_trials: all trials of the search, the profiling trial included (>= 2); a searcher
            proposes at most ``max_trials - 1`` tuning trials.
        zero_stages: the stages to search, each 0..3.
        data_parallel_size: slots per trial (S in the memory model).
        random_seed: seeds the searcher's own ``random.Random``; nothing global is touched.
        base_zero: the user's ``zero_optimization`` section; trial ZeRO configs are built on it.
        trials_per_random_config, early_stopping: ``random`` method.
        search_range_factor: ``binary`` and ``asha``: bisect on [1, factor * approx_max].
        bisect_tolerance: ``binary``: a line stops bisecting upwards once its open range is
            within this fraction of its largest fitting micro-batch ``f``
            (``hi - f <= bisect_tolerance * f``), in ``[0, 1)``; 0 bisects to the last unit.
            Default 0.25: the last trials at the memory boundary (the largest micro-batches,
            often out of memory) buy little. For ``throughput`` and ``FLOPS_per_gpu`` it applies
            only when the best is the largest success below an out-of-memory
            (:mod:`~toolkit.dsat.search.peak`).
        max_rungs, min_binary_search_trials, asha_early_stopping, divisor: ``asha`` method.
        micro_batches: the only micro-batches a trial may use, ascending (the global batch kept:
            the divisors of ``train_batch_size / data_parallel_size``, see
            :mod:`~toolkit.dsat.search.batch`); None: any. Bisection runs over this list.
        max_micro_batch: no trial above it (its predicted step time would pass the trial
            timeout); None: no cap.
        offload: ``auto``, ``never`` or ``always`` (:mod:`~toolkit.dsat.search.offload`).
    """

    method: str
    metric: str = "FLOPS_per_gpu"
    max_trials: int = 50
    zero_stages: tuple[int, ...] = (1, 2, 3)
    data_parallel_size: int = 1
    random_seed: int = 42
    base_zero: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    trials_per_random_config: int = 5
    early_stopping: int | None = None
    search_range_factor: float = 1.0
    bisect_tolerance: float = 0.25
    max_rungs: int = 5
    min_binary_search_trials: int = 3
    asha_early_stopping: int = 0
    divisor: int = 2
    micro_batches: tuple[int, ...] | None = None
    max_micro_batch: int | None = None
    offload: str = "auto"

    def __post_init__(self) -> None:
        p: list[str | None] = []
        if self.method not in SEARCH_METHODS:
            p.append(f"method={self.method!r}: expected one of {', '.join(SEARCH_METHODS)}")
        if self.metric not in METRICS:
            p.append(f"metric={self.metric!r}: expected one of {', '.join(METRICS)}")
        if not self.zero_stages or not all(is_int(s) and 0 <= s <= 3 for s in self.zero_stages):
            p.append(f"zero_stages={self.zero_stages!r}: expected one or more of 0, 1, 2, 3")
        if self.early_stopping is not None:
            p.append(int_problem("early_stopping", self.early_stopping, minimum=1, hint=" or None"))
        if not is_number(self.search_range_factor) or not self.search_range_factor > 0:
            p.append(f"search_range_factor={self.search_range_factor!r}: expected a number > 0")
        if not is_number(self.bisect_tolerance) or not 0 <= self.bisect_tolerance < 1:
            p.append(f"bisect_tolerance={self.bisect_tolerance!r}: expected a number >= 0 and < 1 (0 "
                     "bisects the micro-batch range exactly, 0.25 stops within 25% of the largest fitting "
                     "micro-batch)")
        p += [int_problem("max_trials", self.max_trials, minimum=2, hint=" (it counts the profiling trial)"),
              int_problem("data_parallel_size", self.data_parallel_size, minimum=1),
              int_problem("trials_per_random_config", self.trials_per_random_config, minimum=1),
              int_problem("max_rungs", self.max_rungs, minimum=1),
              int_problem("min_binary_search_trials", self.min_binary_search_trials, minimum=1),
              int_problem("asha_early_stopping", self.asha_early_stopping, minimum=0),
              int_problem("divisor", self.divisor, minimum=2)]
        p += self._micro_batch_problems()
        problems = [problem for problem in p if problem]
        if problems:
            raise ConfigError(problems)


    def _micro_batch_problems(self) -> list[str | None]:
        """The allowed micro-batches (ascending positive integers, 1 first), the cap, the offload mode."""
        p: list[str | None] = []
        mbs = self.micro_batches
        if mbs is not None and (not isinstance(mbs, tuple) or not mbs or not all(is_int(m) for m in mbs)
                                or mbs[0] != 1 or list(mbs) != sorted(set(mbs))):
            p.append(f"micro_batches={mbs!r}: expected a tuple of ascending integers starting at 1, or None")
        if self.max_micro_batch is not None:
            p.append(int_problem("max_micro_batch", self.max_micro_batch, minimum=1, hint=" or None"))
        if self.offload not in OFFLOAD_MODES:
            p.append(f"offload={self.offload!r}: expected one of {', '.join(OFFLOAD_MODES)}")
        elif self.offload == "always" and all(is_int(x) for x in self.zero_stages) \
                and not set(self.zero_stages) & {2, 3}:
            p.append(f"offload='always' with zero_stages={list(self.zero_stages)}: offload needs stage 2 or "
                     "3; add one to zero_stages or use offload 'auto'")
        return p


class Searcher(Protocol):
    """A search method: pure logic over results. Deterministic for a given seed and call order.

    The orchestrator calls :meth:`propose` to fill free capacity and :meth:`observe` with each
    finished trial, in completion order; replaying the recorded results in that order through a
    fresh searcher rebuilds its state (this is how ``--resume`` works,
    :func:`~toolkit.dsat.search.replay.replay`). Rank 0 only by use.

    Example (rank 0; annotate the orchestrator's searcher with this protocol)::

        searcher: Searcher = make_searcher(settings, profile)
    """

    def propose(self, capacity: int) -> list[TrialSpec]:
        """Up to ``capacity`` new trials to start now (may be fewer, or none while waiting)."""
        ...

    def observe(self, result: TrialResult) -> None:
        """Take a finished trial's result into account."""
        ...

    def observe_profiling(self, results: Sequence[TrialResult]) -> list[TrialResult]:
        """Before the first :meth:`propose`: take the profiling trials that ran configurations of
        the search as results (they may be the best); returns those taken."""
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
        """What the user should read, in the order it happened (a config judged both fitting and
        out of memory, and its repeat)."""
        ...

    @property
    def best(self) -> TrialResult | None:
        """The best successful result observed so far, or None."""
        ...
