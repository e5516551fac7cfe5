"""The DeepSpeed keys dsat tunes, merged over a script's config, and an engine held to them.

A trial's tuned keys (:data:`TUNED_KEYS`: the batch triple and the whole ``zero_optimization``
section, offload included) go over the config a script gives ``deepspeed.initialize``
(:func:`merge_tuned`); the rest (optimizer, scheduler, precision, clipping) stays the script's.
:func:`engine_summary` reads what an engine runs, :func:`config_summary` what a config says, and
:func:`mismatches` compares them. Pure but for reading an engine; any process (trials and the
autotuner). Example::

    merged = merge_tuned(script_config, trial_config, instrumented=True)   # inside a trial
    problems = mismatches(engine_summary(engine), config_summary(trial_config))
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from toolkit._checks import is_mapping
from toolkit.config.ds_schema import BATCH_KEYS

__all__ = ["INSTRUMENTATION", "SUMMARY_NAMES", "TUNED_KEYS", "config_summary", "data_batch_sizes",
           "describe_summary", "engine_summary", "merge_tuned", "mismatches", "strip_instrumentation"]

TBS, MBS, GAS = BATCH_KEYS
#: What dsat sets in a trial's config and merges over the script's: the batch triple and ZeRO.
TUNED_KEYS = (TBS, MBS, GAS, "zero_optimization")
#: Merged into every trial's config, never into the best: DeepSpeed's flops profiler and autotuner
#: patch ``torch.nn.functional`` (counting twice) and the autotuner ends the process on its own.
INSTRUMENTATION: Mapping[str, Mapping[str, Any]] = {"flops_profiler": {"enabled": False},
                                                     "autotuning": {"enabled": False}}
#: What a summary holds, and how a message names each.
SUMMARY_NAMES = {"micro_batch": "micro-batch", "gradient_accumulation_steps": "gradient accumulation",
                 "stage": "ZeRO stage", "offload_optimizer": "offload_optimizer",
                 "offload_param": "offload_param"}


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if is_mapping(value) and is_mapping(base.get(key)):
            base[key] = _deep_merge(dict(base[key]), value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def merge_tuned(script_config: Mapping[str, Any], trial_config: Mapping[str, Any], *,
                instrumented: bool) -> dict[str, Any]:
    """``script_config`` with the tuned keys of ``trial_config``: a new dict, neither input changed.

    The batch keys the trial sets replace the script's, and a batch key the trial leaves out is
    dropped (the script's could contradict the trial's triple); the trial's ``zero_optimization``
    replaces the script's whole. ``instrumented``: also :data:`INSTRUMENTATION` (inside a trial).

    >>> merge_tuned({"train_batch_size": 32, "optimizer": {"type": "Adam"}},
    ...             {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
    ...             instrumented=False)
    {'optimizer': {'type': 'Adam'}, 'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 1}
    """
    out = copy.deepcopy(dict(script_config))
    if any(key in trial_config for key in (TBS, MBS, GAS)):
        for key in (TBS, MBS, GAS):
            out.pop(key, None)
    for key in TUNED_KEYS:
        if key in trial_config:
            out[key] = copy.deepcopy(trial_config[key])
    return _deep_merge(out, INSTRUMENTATION) if instrumented else out


def strip_instrumentation(config: Mapping[str, Any], user_config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without what :data:`INSTRUMENTATION` put there: a section equal to it that the
    user's own config does not have. Pure.

    >>> strip_instrumentation({"autotuning": {"enabled": False}, "fp16": {"enabled": True}}, {})
    {'fp16': {'enabled': True}}
    """
    return {key: copy.deepcopy(value) for key, value in config.items()
            if not (key in INSTRUMENTATION and value == INSTRUMENTATION[key] and key not in user_config)}


def _device(section: Any) -> str:
    """An offload section's device (a dict or DeepSpeed's config object); ``"none"`` when absent."""
    if section is None:
        return "none"
    device = section.get("device") if is_mapping(section) else getattr(section, "device", None)
    return str(getattr(device, "value", device) or "none")


def _stage(zero: Any) -> int:
    if is_mapping(zero):
        return int(zero.get("stage", 0))
    return int(bool(zero))  # DeepSpeed's legacy "zero_optimization": true is stage 1


def config_summary(config: Mapping[str, Any]) -> dict[str, Any]:
    """What ``config`` fixes of the summary (:data:`SUMMARY_NAMES`): the batch keys it sets, and
    the stage and offload devices when it has a ZeRO section. Pure.

    >>> config_summary({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})
    {'micro_batch': 2, 'stage': 1, 'offload_optimizer': 'none', 'offload_param': 'none'}
    """
    out: dict[str, Any] = {}
    if MBS in config:
        out["micro_batch"] = config[MBS]
    if GAS in config:
        out["gradient_accumulation_steps"] = config[GAS]
    if "zero_optimization" in config:
        zero = config["zero_optimization"]
        out["stage"] = _stage(zero)
        for key in ("offload_optimizer", "offload_param"):
            out[key] = _device(zero.get(key) if is_mapping(zero) else None)
    return out


def engine_summary(engine: Any) -> dict[str, Any]:
    """What a DeepSpeed engine runs, read from the engine itself (:data:`SUMMARY_NAMES`). Any rank."""
    return {"micro_batch": int(engine.train_micro_batch_size_per_gpu()),
            "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
            "stage": int(engine.zero_optimization_stage()),
            "offload_optimizer": _device(engine.zero_offload_optimizer()),
            "offload_param": _device(engine.zero_offload_param())}


def mismatches(engine: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """Each key of ``expected`` where the engine's summary differs, in words. Pure.

    >>> mismatches({"micro_batch": 2, "stage": 1}, {"micro_batch": 16, "stage": 1})
    ['micro-batch: the engine runs 2, the trial is labelled 16']
    """
    return [f"{SUMMARY_NAMES.get(key, key)}: the engine runs {engine.get(key)!r}, the trial is labelled "
            f"{value!r}" for key, value in expected.items() if engine.get(key) != value]


def data_batch_sizes(args: Sequence[Any], kwargs: Mapping[str, Any]) -> set[int]:
    """Where a forward call's examples may be counted: the first dimension of each tensor argument
    (top level, or one level into a list, tuple or dict), and the second of those with 2 or more
    dimensions (sequence-first layouts: ``[T, B]`` token ids, ``[T, B, H]``). Empty when no tensor is
    passed. Pure; any process."""
    found: set[int] = set()
    values = [*args, *kwargs.values()]
    for value in list(values):
        if isinstance(value, (list, tuple)):
            values.extend(value)
        elif is_mapping(value):
            values.extend(value.values())
    for value in values:
        shape = getattr(value, "shape", None)
        if shape is None or not hasattr(value, "dtype") or len(shape) == 0:
            continue
        found.add(int(shape[0]))
        if len(shape) >= 2:
            found.add(int(shape[1]))
    return found


def describe_summary(summary: Mapping[str, Any]) -> str:
    """A summary in words. Pure.

    >>> describe_summary({"micro_batch": 2, "stage": 1, "offload_optimizer": "none"})
    'micro-batch 2, ZeRO stage 1, offload_optimizer none'
    """
    return ", ".join(f"{SUMMARY_NAMES.get(key, key)} {value}" for key, value in summary.items())
