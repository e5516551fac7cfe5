"""Validate a DeepSpeed config before launch: what DeepSpeed cannot run, every problem at once.

Pure; any rank (nothing is mutated; unknown top-level keys only warn, as
:class:`toolkit.ConfigWarning`). Each rule is a small function returning its problem sentences,
so a rule is read, tested and changed in one place.

Errors follow :mod:`toolkit.errors`: every problem, a ``ds_config`` that is not a mapping
included, is a :class:`~toolkit.errors.ConfigError` listing them all.

Example::

    # torchrun --nproc_per_node 2 train.py
    validate_ds_config(ds_config, device=ctx.device, data_parallel_size=ctx.world_size)
"""

from __future__ import annotations

from typing import Any, Mapping

from toolkit._checks import int_problem, is_int, is_mapping
from toolkit.config.ds_schema import (
    BATCH_KEYS,
    DS_CONFIG_EXPECTED,
    DS_TOP_LEVEL_KEYS,
    GAS,
    MBS,
    OFFLOAD_DEVICES,
    TBS,
    batch_relation_problem,
    require_mapping,
)
from toolkit.config.experiment import warn_unknown_keys
from toolkit.errors import ConfigError

__all__ = ["find_auto", "validate_ds_config"]


def validate_ds_config(ds_config: Mapping[str, Any], *, pipeline: bool = False,
                       device: Any = None, data_parallel_size: int | None = None) -> None:
    """Check a DeepSpeed config for what DeepSpeed cannot run, listing every problem. Pure; any rank.

    Errors: pipeline parallelism with ZeRO stage 2 or 3; ``offload_param`` without stage 3;
    ``offload_optimizer`` with stage 0 or 1; NVMe offload without stage 3; a stage outside 0..3;
    fp16 and bf16 both on; fp16 on a CPU device; batch numbers that are not positive integers;
    a batch relation that does not hold; "auto" values left unresolved. Unknown top-level keys
    are warnings (:class:`toolkit.ConfigWarning`) suggesting the closest known key.

    Args:
        ds_config: the config (not modified).
        pipeline: the engine is a ``PipelineModule`` engine.
        device: the training device (``torch.device`` or string); ``None`` skips device checks.
        data_parallel_size: when given, the batch relation is checked exactly; otherwise only
            that ``train_batch_size`` is a multiple of micro-batch x accumulation.

    Raises:
        ConfigError: listing every problem found (a non-mapping ``ds_config`` included).

    Example::

        validate_ds_config({"train_batch_size": 8, "fp16": {"enabled": True}}, device="cpu")
        # ConfigError: fp16.enabled=true on a CPU device: ...
    """
    require_mapping(ds_config, "ds_config", DS_CONFIG_EXPECTED)
    problems: list[str] = []
    if data_parallel_size is not None:
        dp_problem = int_problem("data_parallel_size", data_parallel_size, minimum=1)
        if dp_problem:
            problems.append(dp_problem)
            data_parallel_size = None
    warn_unknown_keys(ds_config, DS_TOP_LEVEL_KEYS, where="")
    problems += _zero_problems(ds_config, pipeline=pipeline)
    problems += _precision_problems(ds_config, device=device)
    problems += _batch_problems(ds_config, data_parallel_size=data_parallel_size)
    problems += [f"{key}='auto' is unresolved: call resolve_ds_config (with hidden_size= for ZeRO bucket "
                 "sizes) or write a number" for key in find_auto(ds_config)]
    if problems:
        raise ConfigError(problems)


def _stage_and_section(ds_config: Mapping[str, Any], problems: list[str]) -> tuple[int, Mapping[str, Any]]:
    """The ZeRO stage (0 when unreadable, with the problem noted) and the ``zero_optimization`` mapping."""
    zero = ds_config.get("zero_optimization", {})
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true means stage 1
        return int(zero), {}
    if not is_mapping(zero):
        problems.append(f"zero_optimization={zero!r}: expected a mapping such as {{stage: 1}}")
        return 0, {}
    raw = zero.get("stage", 0)
    if not is_int(raw) or not 0 <= raw <= 3:
        problems.append(f"zero_optimization.stage={raw!r}: expected 0, 1, 2 or 3")
        return 0, zero
    return int(raw), zero


def _offload_device(zero: Mapping[str, Any], key: str, problems: list[str]) -> str:
    """``zero_optimization.<key>.device`` ("none" when absent or wrong, with the problem noted)."""
    section = zero.get(key)
    if section is None:
        return "none"
    if not is_mapping(section):
        problems.append(f"zero_optimization.{key}={section!r}: expected a mapping such as {{device: cpu}}")
        return "none"
    device = section.get("device", "none")
    if device not in OFFLOAD_DEVICES:
        problems.append(f"zero_optimization.{key}.device={device!r}: expected one of "
                        f"{', '.join(OFFLOAD_DEVICES)}")
        return "none"
    return str(device)


def _zero_problems(ds_config: Mapping[str, Any], *, pipeline: bool = False) -> list[str]:
    """The ZeRO rules: a valid stage, what pipeline parallelism and each offload need. Pure; any rank."""
    problems: list[str] = []
    stage, zero = _stage_and_section(ds_config, problems)
    if pipeline and stage >= 2:
        problems.append(f"zero_optimization.stage={stage} with pipeline parallelism: DeepSpeed's pipeline "
                        "engine supports ZeRO stage 0 or 1 only; set stage to 1")
    param_dev = _offload_device(zero, "offload_param", problems)
    opt_dev = _offload_device(zero, "offload_optimizer", problems)
    if param_dev != "none" and stage != 3:
        problems.append(f"zero_optimization.offload_param.device={param_dev!r} with stage {stage}: parameter "
                        "offload needs ZeRO stage 3; set stage to 3 or remove offload_param")
    if opt_dev != "none" and stage < 2:
        problems.append(f"zero_optimization.offload_optimizer.device={opt_dev!r} with stage {stage}: "
                        "optimizer offload needs ZeRO stage 2 or 3; raise the stage or remove "
                        "offload_optimizer")
    if "nvme" in (param_dev, opt_dev) and stage != 3:
        key = "offload_optimizer" if opt_dev == "nvme" else "offload_param"
        problems.append(f"zero_optimization.{key}.device='nvme' with stage {stage}: NVMe offload needs ZeRO "
                        "stage 3; set stage to 3 or offload to 'cpu'")
    if zero.get("cpu_offload") is True and stage < 2:
        problems.append(f"zero_optimization.cpu_offload=true with stage {stage}: optimizer offload needs "
                        "ZeRO stage 2 or 3")
    if zero.get("cpu_offload_params") is True and stage != 3:
        problems.append(f"zero_optimization.cpu_offload_params=true with stage {stage}: parameter offload "
                        "needs ZeRO stage 3")
    return problems


def _enabled(ds_config: Mapping[str, Any], *keys: str) -> bool:
    """True when any of the sections ``keys`` is a mapping with ``enabled: true``."""
    for key in keys:
        section: Any = ds_config.get(key)
        if is_mapping(section) and section.get("enabled") is True:
            return True
    return False


def _precision_problems(ds_config: Mapping[str, Any], *, device: Any = None) -> list[str]:
    """fp16 and bf16 both on; fp16 on a CPU device (``device=None`` skips it). Pure; any rank."""
    problems = []
    fp16 = _enabled(ds_config, "fp16")
    bf16 = _enabled(ds_config, "bf16", "bfloat16")
    if fp16 and bf16:
        problems.append("fp16.enabled and bf16.enabled are both true: choose one precision")
    if fp16 and device is not None and str(device).split(":")[0] == "cpu":
        problems.append("fp16.enabled=true on a CPU device: DeepSpeed's CPU accelerator does not support "
                        "fp16; use bf16 or fp32 on CPU")
    return problems


def _batch_problems(ds_config: Mapping[str, Any], *, data_parallel_size: int | None = None) -> list[str]:
    """Batch numbers that are not positive integers, and the batch relation. Pure; any rank.

    "auto" is left to :func:`find_auto`. Without ``data_parallel_size`` only divisibility is checked.
    """
    problems = []
    numbers = {}
    for key in BATCH_KEYS:
        value = ds_config.get(key, "auto")
        if value == "auto":
            continue  # absent, or reported with the other unresolved values
        if not is_int(value) or value < 1:
            problems.append(f"{key}={value!r}: expected a positive integer")
        else:
            numbers[key] = int(value)
    if len(numbers) < 3:
        return problems
    tbs, mbs, gas = numbers[TBS], numbers[MBS], numbers[GAS]
    if data_parallel_size is not None:
        relation = batch_relation_problem(tbs, mbs, gas, data_parallel_size)
        if relation:
            problems.append(relation)
    elif tbs % (mbs * gas):
        problems.append(f"{TBS}={tbs} is not a multiple of {MBS}={mbs} x {GAS}={gas} = {mbs * gas}, so "
                        "no data-parallel size satisfies the batch relation")
    return problems


def find_auto(node: Any, prefix: str = "") -> list[str]:
    """The dotted paths of every value that is still ``"auto"``. Pure; any rank.

    Example:
        >>> find_auto({"zero_optimization": {"reduce_bucket_size": "auto"}})
        ['zero_optimization.reduce_bucket_size']
    """
    if is_mapping(node):
        found = []
        for key, value in node.items():
            found += find_auto(value, f"{prefix}{key}.")
        return found
    return [prefix[:-1]] if node == "auto" else []
