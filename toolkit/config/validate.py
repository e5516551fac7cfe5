"""Validate a DeepSpeed config before launch as DeepSpeed 0.19 judges it, every problem at once.

Refused: one ConfigError; run but ignored or reinterpreted: a ConfigWarning (docs/configs.md lists
both). The ZeRO and precision rules are here, the engine's in :mod:`toolkit.config.ds_engine_rules`;
tests/config/test_ds_verdicts.py checks the verdicts against DeepSpeed's own. Pure (the device rules
read this machine's fp16 support and libaio once); any rank.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

from toolkit._checks import int_problem, is_int, is_mapping, is_number
from toolkit.config.ds_engine_rules import (
    checkpoint_problems,
    communication_problems,
    cpu_supports_fp16,
    deepspeed_version,
    device_kind,
    is_tested_deepspeed,
    libaio_found,
    optimizer_name,
    optimizer_rules,
    scheduler_problems,
    unknown_key_sentence,
)
from toolkit.config.ds_schema import (
    AUTO_DROPPING_SECTIONS,
    BATCH_KEYS,
    DS_CONFIG_EXPECTED,
    DS_TOP_LEVEL_KEYS,
    GAS,
    MBS,
    MODEL_SECTION_KEYS,
    OFFLOAD_DEVICES,
    REMOVED_TOP_LEVEL_KEYS,
    REMOVED_ZERO_KEYS,
    TBS,
    batch_relation_problem,
    require_mapping,
    stage_value,
    tested_deepspeed_range,
)
from toolkit.config.experiment import ConfigWarning, warn_unknown_keys
from toolkit.config.resolve import resolve_ds_config
from toolkit.errors import ConfigError

__all__ = ["find_auto", "validate_ds_config"]


def validate_ds_config(ds_config: Mapping[str, Any], *, pipeline: bool = False,
                       device: Any = None, data_parallel_size: int | None = None) -> None:
    """Judge a DeepSpeed config as DeepSpeed 0.19 would; one ConfigError lists every problem. Any rank.

    What DeepSpeed runs but ignores or reinterprets is a :class:`toolkit.ConfigWarning`.
    ``pipeline``: a ``PipelineModule`` engine (ZeRO 0 or 1 only). ``device``: the training device;
    None skips the device rules. ``data_parallel_size``: checks the batch relation exactly, else only
    divisibility. Under a DeepSpeed outside ``TESTED_DEEPSPEED`` the refusals are warnings (the batch
    arithmetic and NaN stay errors)::

        # torchrun --nproc_per_node 2 train.py
        validate_ds_config(ds_config, device=ctx.device, data_parallel_size=ctx.world_size)
    """
    require_mapping(ds_config, "ds_config", DS_CONFIG_EXPECTED)
    problems: list[str] = []
    notes: list[str] = []
    kept: list[str] = []   # refused under any DeepSpeed release: the arguments, the batch arithmetic, NaN
    if data_parallel_size is not None:
        dp_problem = int_problem("data_parallel_size", data_parallel_size, minimum=1)
        if dp_problem:
            kept.append(dp_problem)
            data_parallel_size = None
    warn_unknown_keys(ds_config, DS_TOP_LEVEL_KEYS, where="")
    problems += [f"{key}: {why}" for key, why in REMOVED_TOP_LEVEL_KEYS.items() if key in ds_config]
    stage, zero, opt_device = _zero_rules(ds_config, pipeline=pipeline, device=device, problems=problems,
                                          notes=notes)
    problems += _precision_problems(ds_config, device=device, stage=stage)
    kept += _batch_problems(ds_config, data_parallel_size=data_parallel_size)
    optimizer_rules(ds_config, stage=stage, cpu_optimizer=opt_device != "none", device=device,
                    problems=problems)
    problems += scheduler_problems(ds_config)
    problems += communication_problems(ds_config, stage=stage, zero=zero)
    problems += checkpoint_problems(ds_config)
    _auto_rules(ds_config, problems=problems, notes=notes)
    kept += [f"{key}={value!r}: expected a finite number" for key, value in _non_finite(ds_config)]
    version = deepspeed_version()
    if version is not None and not is_tested_deepspeed(version):
        _say_untested(version)
        notes += [f"{problem} (DeepSpeed {tested_deepspeed_range()} refuses this; {version} may not)"
                  for problem in problems]
        problems = []
    for note in notes:
        warnings.warn(note, ConfigWarning, stacklevel=2)
    if problems or kept:
        raise ConfigError(problems + kept)


_untested_said: set[str] = set()


def _say_untested(version: str) -> None:
    """One warning per process and version: the rules are not this DeepSpeed's."""
    if version not in _untested_said:
        _untested_said.add(version)
        tested = tested_deepspeed_range()
        warnings.warn(f"DeepSpeed {version} is installed, but toolkit's config validator mirrors the rules "
                      f"of DeepSpeed {tested}, the releases it is tested with: what those refuse is only a "
                      "warning here, and deepspeed.initialize has the last word; install "
                      f"'deepspeed{tested}' for verdicts before launch", ConfigWarning, stacklevel=3)


def _auto_rules(ds_config: Mapping[str, Any], *, problems: list[str], notes: list[str]) -> None:
    """"auto" left in a config: DeepSpeed's config models drop it (a warning); elsewhere DeepSpeed
    would use the string "auto" as the value (an error)."""
    fix = "call resolve_ds_config (with hidden_size= for ZeRO bucket sizes) or write a value"
    for key in find_auto(ds_config):
        if key.split(".")[0] in AUTO_DROPPING_SECTIONS:
            notes.append(f"{key}='auto' is unresolved: DeepSpeed drops it and uses its default; {fix}")
        else:
            problems.append(f"{key}='auto' is unresolved: DeepSpeed would use the string 'auto'; {fix}")


def _zero_section(ds_config: Mapping[str, Any], problems: list[str], notes: list[str]
                  ) -> tuple[int, Mapping[str, Any]]:
    """The ZeRO stage (0 when unreadable, with the problem noted) and the ``zero_optimization`` mapping,
    with unknown and removed keys noted."""
    zero = ds_config.get("zero_optimization", {})
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true means stage 1
        return int(zero), {}
    if not is_mapping(zero):
        problems.append(f"zero_optimization={zero!r}: expected a mapping such as {{stage: 1}}")
        return 0, {}
    known = MODEL_SECTION_KEYS["zero_optimization"]
    for key in zero:
        if key in REMOVED_ZERO_KEYS:
            problems.append(f"zero_optimization.{key}: {REMOVED_ZERO_KEYS[key]}")
        elif key not in known:
            problems.append(unknown_key_sentence(f"zero_optimization.{key}", known))
    raw = zero.get("stage", 0)
    stage = 0 if raw == "auto" else stage_value(raw)  # an "auto" stage is dropped: DeepSpeed's default, 0
    if stage is None:
        problems.append(f"zero_optimization.stage={raw!r}: expected 0, 1, 2 or 3")
        return 0, zero
    if raw != "auto" and not is_int(raw):
        notes.append(f"zero_optimization.stage={raw!r} is not an integer: DeepSpeed reads it as {stage}; "
                     f"write {stage}")
    return stage, zero


def _offload_device(zero: Mapping[str, Any], key: str, problems: list[str]) -> str:
    """``zero_optimization.<key>.device`` ("none" when absent or wrong, with the problem noted), the
    deprecated ``cpu_offload`` / ``cpu_offload_param`` flags read as DeepSpeed reads them."""
    section = zero.get(key)
    if section is None:
        legacy = "cpu_offload" if key == "offload_optimizer" else "cpu_offload_param"
        return "cpu" if zero.get(legacy) is True else "none"
    if not is_mapping(section):
        problems.append(f"zero_optimization.{key}={section!r}: expected a mapping such as {{device: cpu}}")
        return "none"
    known = MODEL_SECTION_KEYS[f"zero_optimization.{key}"]
    problems += [unknown_key_sentence(f"zero_optimization.{key}.{k}", known)
                 for k in section if k not in known]
    device = section.get("device", "none")
    if device == "auto":
        return "none"  # dropped: DeepSpeed's default
    if device not in OFFLOAD_DEVICES:
        problems.append(f"zero_optimization.{key}.device={device!r}: expected one of "
                        f"{', '.join(OFFLOAD_DEVICES)} (lower case)")
        return "none"
    return str(device)


def _zero_rules(ds_config: Mapping[str, Any], *, pipeline: bool, device: Any, problems: list[str],
                notes: list[str]) -> tuple[int, Mapping[str, Any], str]:
    """The ZeRO rules: a valid stage and section, what pipeline parallelism and each offload need or
    ignore at each stage. Returns (stage, section, optimizer offload device). Long because each
    offload rule is one branch of DeepSpeed's stage 1/2 and stage 3 optimizers, kept together."""
    stage, zero = _zero_section(ds_config, problems, notes)
    if pipeline and stage >= 2:
        problems.append(f"zero_optimization.stage={stage} with pipeline parallelism: DeepSpeed's pipeline "
                        "engine supports ZeRO stage 0 or 1 only; set stage to 1")
    param_dev = _offload_device(zero, "offload_param", problems)
    opt_dev = _offload_device(zero, "offload_optimizer", problems)
    if param_dev != "none" and stage != 3:
        notes.append(f"zero_optimization.offload_param (device {param_dev!r}) is ignored at stage {stage}: "
                     "only ZeRO stage 3 offloads parameters; set stage 3 or remove offload_param")
    kind = device_kind(device)
    if opt_dev != "none":
        _optimizer_offload_rules(ds_config, stage=stage, opt_dev=opt_dev, device=device, problems=problems,
                                 notes=notes)
    if opt_dev == "nvme" and stage in (1, 2):
        notes.append(f"zero_optimization.offload_optimizer.device='nvme' at stage {stage} keeps the "
                     "optimizer state in CPU memory (stages 1 and 2 offload to cpu only); set stage 3 for "
                     "NVMe, or write 'cpu'")
    for key, dev in (("offload_param", param_dev), ("offload_optimizer", opt_dev)):
        if dev == "nvme" and stage == 3:
            section = zero.get(key)
            if not is_mapping(section) or section.get("nvme_path") in (None, "auto"):
                problems.append(f"zero_optimization.{key}.nvme_path is missing: NVMe offload at stage 3 "
                                "needs the directory on the NVMe device to swap to; set nvme_path or offload "
                                "to 'cpu'")
            elif kind is not None and not libaio_found():
                problems.append(f"zero_optimization.{key}.device='nvme', judged on this machine: DeepSpeed's "
                                "async_io op needs libaio, which is not installed; install libaio-dev "
                                "(libaio-devel) or offload to 'cpu'")
    offload = zero.get("offload_optimizer")
    ratio = offload.get("ratio", 1.0) if is_mapping(offload) else 1.0
    if is_number(ratio) and ratio < 1.0 and stage != 3:
        problems.append(f"zero_optimization.offload_optimizer.ratio={ratio!r} with stage {stage}: partial "
                        "offloading needs ZeRO stage 3; set stage 3 or remove ratio")
    if zero.get("compute_grad_norm") is False and stage not in (1, 2):
        problems.append(f"zero_optimization.compute_grad_norm=false with stage {stage}: DeepSpeed supports "
                        "it with ZeRO stage 1 or 2 only; remove it or change the stage")
    return stage, zero, opt_dev


def _optimizer_offload_rules(ds_config: Mapping[str, Any], *, stage: int, opt_dev: str, device: Any,
                             problems: list[str], notes: list[str]) -> None:
    """An optimizer offload makes DeepSpeed build its CPU optimizer kernels at every stage
    (``zero_use_cpu_optimizer``): at stage 0 nothing is partitioned, and a GPU's parameters are
    refused by those kernels; a script's own optimizer is refused unless it is one of them."""
    name = optimizer_name(ds_config)
    params = ds_config["optimizer"].get("params") if name is not None else None
    torch_adam = is_mapping(params) and bool(params.get("torch_adam"))
    cpu_kernel = name in ("adagrad", "lion") or (name in ("adam", "adamw") and not torch_adam)
    kind = device_kind(device)
    if stage == 0 and cpu_kernel and kind not in (None, "cpu"):
        problems.append(f"zero_optimization.offload_optimizer (device {opt_dev!r}) at stage 0, judged for "
                        f"device {device}: stage 0 offloads nothing, and the CPU optimizer DeepSpeed then "
                        f"builds refuses parameters on {kind}; use stage 1, 2 or 3, or remove "
                        "offload_optimizer")
    elif stage == 0:
        notes.append(f"zero_optimization.offload_optimizer (device {opt_dev!r}) at stage 0 offloads nothing "
                     "(stage 0 partitions nothing; DeepSpeed only switches to its CPU optimizer); use stage "
                     "1, 2 or 3 to offload, or remove offload_optimizer")
    if name is None and ds_config.get("zero_force_ds_cpu_optimizer", True) is not False:
        notes.append(f"zero_optimization.offload_optimizer (device {opt_dev!r}) with no optimizer section: "
                     "DeepSpeed accepts only a DeepSpeedCPUAdam or DeepSpeedCPULion from the script, unless "
                     "zero_force_ds_cpu_optimizer is false; add an optimizer section or pass one of those")


def _enabled(ds_config: Mapping[str, Any], *keys: str) -> bool:
    """True when any of the sections ``keys`` is a mapping with ``enabled: true``."""
    for key in keys:
        section: Any = ds_config.get(key)
        if is_mapping(section) and section.get("enabled") is True:
            return True
    return False


def _precision_problems(ds_config: Mapping[str, Any], *, device: Any = None, stage: int = 0) -> list[str]:
    """The precision sections: known keys, one precision, fp16 on a CPU that supports it, master
    weights in low precision only under ZeRO (``device=None`` skips the device rule)."""
    problems = []
    for key in ("fp16", "bf16", "bfloat16"):
        section = ds_config.get(key)
        if section is None:
            continue
        if not is_mapping(section):
            problems.append(f"{key}={section!r:.80}: expected a mapping such as {{enabled: true}}")
            continue
        known = MODEL_SECTION_KEYS[key]
        problems += [unknown_key_sentence(f"{key}.{k}", known) for k in section if k not in known]
        for flag in ("fp16_master_weights_and_grads", "bf16_master_weights_and_grads",
                     "bf16_optimizer_states"):
            if section.get(flag) is True and stage == 0:
                problems.append(f"{key}.{flag}=true without ZeRO: DeepSpeed supports it with ZeRO stage 1, 2 "
                                "or 3")
    fp16 = _enabled(ds_config, "fp16")
    if fp16 and _enabled(ds_config, "bf16" if "bf16" in ds_config else "bfloat16"):
        problems.append("fp16.enabled and bf16.enabled are both true: choose one precision")
    if fp16 and device_kind(device) == "cpu" and not cpu_supports_fp16():
        problems.append("fp16.enabled=true, judged for device cpu: this CPU has no fp16 support (oneDNN), so "
                        "DeepSpeed refuses fp16; use bf16 or fp32 on it (on a GPU, fp16 runs)")
    return problems


def _batch_problems(ds_config: Mapping[str, Any], *, data_parallel_size: int | None = None) -> list[str]:
    """Batch values that are not positive integers, and the batch relation. Pure; any rank.

    Without ``data_parallel_size`` only divisibility; with it, one or two keys given must complete
    exactly (DeepSpeed floors, then refuses); none given is left to :func:`resolve_ds_config`."""
    problems = []
    numbers = {}
    for key in BATCH_KEYS:
        value = ds_config.get(key, "auto")
        if value == "auto" or value is None:
            continue  # absent (DeepSpeed reads None as absent), or reported with the unresolved values
        if not is_int(value) or value < 1:
            problems.append(f"{key}={value!r}: expected a positive integer")
        else:
            numbers[key] = int(value)
    if len(numbers) < 3:
        if data_parallel_size is not None and not problems and (TBS in numbers or MBS in numbers) \
                and not any(ds_config.get(key) == "auto" for key in BATCH_KEYS):
            try:  # DeepSpeed completes the triple by floor division, then asserts the relation
                resolve_ds_config(numbers, data_parallel_size=data_parallel_size)
            except ConfigError as err:
                problems += err.problems
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
    """The dotted paths of every value that is still ``"auto"``. Pure; any rank."""
    if is_mapping(node):
        found = []
        for key, value in node.items():
            found += find_auto(value, f"{prefix}{key}.")
        return found
    return [prefix[:-1]] if node == "auto" else []


def _non_finite(node: Any, prefix: str = "") -> list[tuple[str, float]]:
    """The dotted paths and values of every NaN or infinite number, lists included. Pure."""
    if is_mapping(node):
        return [hit for key, value in node.items() for hit in _non_finite(value, f"{prefix}{key}.")]
    if isinstance(node, (list, tuple)):
        return [hit for i, value in enumerate(node) for hit in _non_finite(value, f"{prefix[:-1]}[{i}].")]
    if isinstance(node, float) and not math.isfinite(node):
        return [(prefix[:-1], node)]
    return []
