"""The contract between the autotuner and a trial: the trial file (:class:`TrialContract`, named by
``TOOLKIT_DSAT_TRIAL``, one of :mod:`toolkit.runtime.trial_env`'s variables) and the result file,
written atomically by the trial's chief or by a rank out of memory (its fields:
docs/design-dsat-search.md#inside-a-trial). The trial's code imports this module; it imports nothing
of the tuner.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import os
from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import is_mapping
from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.errors import ConfigError

__all__ = [
    "MAX_ERROR_CHARS",
    "METRICS",
    "MISMATCH_EXIT_STATUS",
    "OOM_EXIT_STATUS",
    "PROGRESS_FILE",
    "ProfileInfo",
    "TrialContract",
    "TrialStatus",
    "clip_error",
    "trial_hparams",
]

#: Exit status of a trial process that ran out of memory (EX_TEMPFAIL: the config does not fit).
OOM_EXIT_STATUS = 75
#: Exit status of a trial whose engine runs another config than the trial's (EX_CONFIG).
MISMATCH_EXIT_STATUS = 78

#: Metrics a trial reports. Units: FLOPS_per_gpu in floating-point operations per second per
#: rank; throughput in samples per second over all ranks; forward, backward and latency in
#: milliseconds per training step (latency = the whole step: forward + backward + optimizer).
METRICS = ("FLOPS_per_gpu", "throughput", "forward", "backward", "latency")
#: The longest error text of a trial that the autotuner keeps (records, tables, console).
MAX_ERROR_CHARS = 2000
#: Beside the trial file: where a trial's chief says how far it got (the runner's heartbeat reads
#: it): ``{"step": 4, "timed": 1, "to_time": 3, "peak_bytes": ..., "time": ...}``.
PROGRESS_FILE = "progress.json"


def clip_error(text: str | None, *, where: str = "") -> str | None:
    """``text`` cut to :data:`MAX_ERROR_CHARS` (its head and its tail), saying how much was cut and that
    ``where`` (e.g. the trial's ``result.json``) holds the whole. Pure."""
    if text is None or len(text) <= MAX_ERROR_CHARS:
        return text
    half = MAX_ERROR_CHARS // 2
    whole = f"; the whole text is in {where}" if where else ""
    note = f" [... {len(text) - 2 * half:,} characters cut{whole} ...] "
    return text[:half] + note + text[-half:]


class TrialStatus(str, enum.Enum):
    """How a trial ended. Decided from exit status and the result file, never from logs."""

    OK = "ok"              # result file with metrics, exit status 0
    OOM = "oom"            # out of memory: CUDA OOM reported by the trial, or the CPU budget exceeded
    FAILED = "failed"      # any other failure: non-zero exit, no or corrupt result file
    TIMEOUT = "timeout"    # ran past the per-trial timeout; its process group was killed
    MISMATCH = "mismatch"  # its engine ran another config than the trial's: no result; the search stops


@dataclasses.dataclass(frozen=True)
class ProfileInfo:
    """What a profiling trial measured (the first at micro-batch 1), or the memory model's calibrated view of
    two of them (:func:`toolkit.dsat.search.calibration.calibrate`); how each is measured and used:
    docs/design-dsat-search.md#the-memory-model and #inside-a-trial.

    Sizes are bytes. ``activation_bytes_per_example``: measured, the leaf modules' outputs per example
    (a lower bound); calibrated, the slope of the peak per example. ``memory_per_slot``: the GPU's
    memory, or the CPU budget. ``baseline_bytes``: per slot besides model state and examples
    (calibrated: the peak's intercept at micro-batch 0). ``micro_batch``: 0 in records older than the
    field. ``peak_bytes``, ``startup_peak_bytes``: the largest rank's peak over the training steps and
    before the first step (0: not measured). ``stage_extra_bytes``: by stage (as a string), the peak a
    stage's point measured beyond the line and the formula; a positive one referred to the calibration
    micro-batch, growing in proportion beyond its point, a negative one fixed."""

    num_params: int
    trainable_params: int
    activation_bytes_per_example: int
    memory_per_slot: int
    baseline_bytes: int = 0
    half_precision: bool = False
    device: str = "cpu"
    micro_batch: int = 0
    peak_bytes: int = 0
    startup_peak_bytes: int = 0
    calibrated: bool = False
    stage_extra_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "stage_extra_bytes": dict(self.stage_extra_bytes)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ProfileInfo":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    @classmethod
    def problem(cls, data: Any) -> str | None:
        """What is wrong with a profile as parsed from JSON (a result file, a record), or None: counts
        integers >= 0 (not ``bool``), flags booleans, ``device`` cpu or cuda; the fields without a
        default required. Pure."""
        if not is_mapping(data):
            return f"expected an object with the profiling trial's measurements, got {type(data).__name__}"
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            return f"missing {', '.join(missing)}"
        for name in (*required, "baseline_bytes", "micro_batch", "peak_bytes", "startup_peak_bytes"):
            value = data.get(name, 0)
            if type(value) is not int or value < 0:  # parsed JSON: bool is its only int subclass
                return f"{name}={value!r:.60}: expected an integer count >= 0"
        for name in ("half_precision", "calibrated"):
            if not isinstance(data.get(name, False), bool):
                return f"{name}={data[name]!r:.60}: expected true or false"
        if data.get("device", "cpu") not in ("cpu", "cuda"):
            return f"device={data['device']!r:.60}: expected 'cpu' or 'cuda'"
        extra = data.get("stage_extra_bytes", {})
        if not is_mapping(extra) or not all(isinstance(k, str) and type(v) is int for k, v in extra.items()):
            return f"stage_extra_bytes={extra!r:.100}: expected an object of integers by stage"
        return None


@dataclasses.dataclass(frozen=True)
class TrialContract:
    """The JSON file named by ``TOOLKIT_DSAT_TRIAL``, read inside the trial's processes: which steps to
    time (``start_profile_step`` to ``end_profile_step``, more up to ``last_profile_step`` while they
    span less than ``timed_window_s``; None: no more), the trial's ``ds_config`` its engine is checked
    against (None: not checked), and ``merge_config`` (:mod:`toolkit.dsat.trial.engine_hook`)."""

    trial_id: int
    result_path: str
    start_profile_step: int
    end_profile_step: int
    profile: bool = False
    memory_per_slot: int | None = None
    timed_window_s: float = 0.0
    last_profile_step: int | None = None
    ds_config: str | None = None
    merge_config: bool = True

    @property
    def final_step_bound(self) -> int:
        """The last step a trial may run: ``last_profile_step``, at least ``end_profile_step``."""
        return max(self.end_profile_step, self.last_profile_step or 0)

    def write(self, path: Path) -> None:
        """Write the contract to ``path`` (atomically: a trial never reads half of it)."""
        atomic_write_json(path, dataclasses.asdict(self))

    @classmethod
    def read(cls, path: str | Path) -> "TrialContract":
        """The contract in ``path``. Raises ConfigError naming the file when it is damaged."""
        data = load_json(path, what="trial file")
        try:
            return cls(**data)
        except TypeError as err:
            raise ConfigError(f"not a trial file of this toolkit version ({err})", source=str(path)) from None


def trial_hparams(hparams: Mapping[str, Any], *, ds_config: Mapping[str, Any],
                  ds_config_path: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``TOOLKIT_TRIAL_HPARAMS`` holds for a run with ``ds_config``, the one place it is made: the
    hyperparameters (deep-copied) with ``deepspeed_config`` = ``ds_config_path``, without
    ``overwrite_deepspeed_args`` (merged already), and a ``global_batch_size`` the user names set to the
    config's ``train_batch_size``. Pure; autotuner process only (trials read the file)."""
    out = copy.deepcopy(dict(hparams))
    out.pop("overwrite_deepspeed_args", None)
    if "global_batch_size" in out and "train_batch_size" in ds_config:
        out["global_batch_size"] = ds_config["train_batch_size"]
    out["deepspeed_config"] = os.fspath(ds_config_path)
    return out
