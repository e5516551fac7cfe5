"""The rules DeepSpeed 0.19's engine applies to the optimizer, LR scheduler, gradient reduction and
checkpoint settings in ``deepspeed.initialize``, mirrored for :func:`toolkit.validate_ds_config`.

Mirrored from ``runtime/engine.py`` (``_configure_basic_optimizer``, ``_do_sanity_check``,
``_do_optimizer_sanity_check``, ``_scheduler_from_config``), ``runtime/config.py`` and ``runtime/zero/``.
Each rule appends to ``problems`` (refused) or ``notes`` (a ConfigWarning); device rules name the
device judged for, ``device=None`` skips them. Pure but for this CPU's fp16 support and libaio,
read once per process; any rank.
"""

from __future__ import annotations

import ctypes.util
import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
from typing import Any, Mapping

from toolkit._checks import is_mapping, is_number
from toolkit.config.ds_schema import (
    CPU_ADAM_KWARGS,
    DS_OPTIMIZERS,
    DS_SCHEDULERS,
    FUSED_ADAM_KWARGS,
    TESTED_DEEPSPEED,
    ZERO_TESTED_OPTIMIZERS,
)

__all__ = ["checkpoint_problems", "communication_problems", "cpu_supports_fp16", "deepspeed_version",
           "device_kind", "is_tested_deepspeed", "libaio_found", "optimizer_name", "optimizer_rules",
           "scheduler_problems", "unknown_key_sentence"]

_ADAM_READ_FIRST = ("adam_w_mode", "torch_adam", "fp32_optimizer_states")
_WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def device_kind(device: Any) -> str | None:
    """``"cpu"``, ``"cuda"``, ... for a ``torch.device`` or a string; None when no device is given."""
    return None if device is None else str(device).split(":")[0]


@functools.lru_cache(maxsize=1)
def cpu_supports_fp16() -> bool:
    """What DeepSpeed's CPU accelerator answers for fp16 (``is_fp16_supported``): oneDNN fp16 support."""
    try:
        import torch
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # DeepSpeed answers False on any failure too
        return False


@functools.lru_cache(maxsize=1)
def _installed_deepspeed() -> str | None:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def deepspeed_version() -> str | None:
    """The DeepSpeed the rules judge for: the imported module's ``__version__``, else the installed
    distribution's (DeepSpeed is not imported for it); None when none is installed. Any rank."""
    module = sys.modules.get("deepspeed")
    version = getattr(module, "__version__", None) if module is not None else None
    return version if isinstance(version, str) else _installed_deepspeed()


def is_tested_deepspeed(version: str | None) -> bool:
    """Whether ``version`` is in :data:`~toolkit.config.ds_schema.TESTED_DEEPSPEED` ("0.19.8" is,
    "0.14.4+cu121" is not); None, no DeepSpeed installed, counts as tested. Pure."""
    if version is None:
        return True
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    low, high = TESTED_DEEPSPEED
    return match is not None and low <= (int(match[1]), int(match[2])) < high


@functools.lru_cache(maxsize=1)
def libaio_found() -> bool:
    """Whether libaio, which DeepSpeed's async_io op (NVMe offload) links against, is installed here."""
    return ctypes.util.find_library("aio") is not None


def unknown_key_sentence(path: str, known: Any) -> str:
    """``path`` is not a key DeepSpeed's config model allows, with the closest known key."""
    close = difflib.get_close_matches(path.rsplit(".", 1)[-1], sorted(known), n=1, cutoff=0.7)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{path}: DeepSpeed refuses keys it does not know in this section{hint}"


def optimizer_name(ds_config: Mapping[str, Any]) -> str | None:
    """The optimizer DeepSpeed builds from the config: a DeepSpeed name lower-cased, a torch.optim
    name as written; None when the config names none (the script passes its own)."""
    section = ds_config.get("optimizer")
    kind = section.get("type") if is_mapping(section) else None
    if not isinstance(kind, str):
        return None
    return kind.lower() if kind.lower() in DS_OPTIMIZERS else kind


def _torch_attr(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _signature_names(cls: Any) -> tuple[set[str] | None, list[str]]:
    """(the keyword names a constructor takes after its first argument, or None when it takes
    ``**kwargs``; the names it requires)."""
    try:
        params = list(inspect.signature(cls).parameters.values())[1:]
    except (TypeError, ValueError):
        return None, []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None, []
    names = {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    return names, required


def _optimizer_kernel(name: str, kind: str, params: Mapping[str, Any], cpu_optimizer: bool
                      ) -> tuple[str, set[str] | None]:
    """(the class DeepSpeed builds for ``optimizer.type``, the ``params`` keys it accepts or None)."""
    if name in ("adam", "adamw"):
        if params.get("torch_adam"):
            names, _ = _signature_names(_torch_attr("torch.optim", "AdamW"))
            return "torch.optim.AdamW", None if names is None else {*names, *_ADAM_READ_FIRST}
        if cpu_optimizer:
            return "DeepSpeedCPUAdam", {*CPU_ADAM_KWARGS, *_ADAM_READ_FIRST}
        return "FusedAdam", {*FUSED_ADAM_KWARGS, *_ADAM_READ_FIRST}
    if name in DS_OPTIMIZERS:
        kernels = {"lamb": "FusedLamb", "lion": "DeepSpeedCPULion" if cpu_optimizer else "FusedLion",
                   "adagrad": "DeepSpeedCPUAdagrad" if cpu_optimizer else "torch.optim.Adagrad"}
        return kernels.get(name, name), None
    names, _ = _signature_names(_torch_attr("torch.optim", kind))
    return f"torch.optim.{kind}", names


def optimizer_rules(ds_config: Mapping[str, Any], *, stage: int, cpu_optimizer: bool, device: Any,
                    problems: list[str]) -> None:
    """``optimizer``: a type DeepSpeed builds, parameters its class takes, a kernel for the device,
    and, under ZeRO, an optimizer ZeRO supports. ``cpu_optimizer``: an optimizer offload is set
    (DeepSpeed then builds its CPU kernels, at any stage). Long because each branch is one
    DeepSpeed rule, read in the order ``deepspeed.initialize`` applies them."""
    section = ds_config.get("optimizer")
    if section is None:
        return
    if not is_mapping(section):
        problems.append(f"optimizer={section!r:.80}: expected a mapping such as "
                        "{type: AdamW, params: {lr: 0.001}}")
        return
    kind = section.get("type")
    if kind is None:
        return  # DeepSpeed builds no optimizer; the script passes its own
    params = section.get("params") or {}
    if not isinstance(kind, str) or not is_mapping(params):
        bad = "type" if not isinstance(kind, str) else "params"
        expected = "a name such as 'AdamW'" if bad == "type" else "a mapping of the optimizer's arguments"
        problems.append(f"optimizer.{bad}={section.get(bad)!r:.80}: expected {expected}")
        return
    name = kind.lower() if kind.lower() in DS_OPTIMIZERS else kind
    if name not in DS_OPTIMIZERS and _torch_attr("torch.optim", kind) is None:
        problems.append(f"optimizer.type={kind!r}: DeepSpeed 0.19 builds {', '.join(DS_OPTIMIZERS)} (any "
                        "case) or a torch.optim class by its exact name (e.g. 'SGD'); OneBitAdam, "
                        "ZeroOneAdam and OneBitLamb were removed from DeepSpeed")
        return
    if "max_grad_norm" in params:
        problems.append("optimizer.params.max_grad_norm: DeepSpeed refuses it as an optimizer parameter; set "
                        "the top-level gradient_clipping instead")
    kernel, allowed = _optimizer_kernel(name, kind, params, cpu_optimizer)
    if kernel in ("FusedAdam", "DeepSpeedCPUAdam") and params.get("amsgrad"):
        problems.append(f"optimizer.params.amsgrad={params['amsgrad']!r}: {kernel}, the optimizer DeepSpeed "
                        "builds here, does not support AMSGrad; set torch_adam: true (torch's Adam has it) "
                        "or remove amsgrad")
    if device_kind(device) == "cpu" and kernel in ("FusedLamb", "FusedLion"):
        problems.append(f"optimizer.type={kind!r}, judged for device cpu: DeepSpeed builds {kernel}, which "
                        "has no CPU kernel (it runs on a GPU); use Adam or AdamW"
                        + (", or offload the optimizer to cpu (DeepSpeedCPULion)" if name == "lion" else ""))
    if name in ("muadam", "muadamw", "musgd") and importlib.util.find_spec("mup") is None:
        problems.append(f"optimizer.type={kind!r}: DeepSpeed builds it from the 'mup' package, which is not "
                        "installed; pip install mup or choose another optimizer")
    for key in sorted(set(params) - (allowed or set(params)) - {"max_grad_norm"}):
        problems.append(f"optimizer.params.{key}: not an argument of {kernel}, the optimizer DeepSpeed "
                        f"builds for type {kind!r} here; expected some of {', '.join(sorted(allowed or ()))}")
    untested_allowed = ds_config.get("zero_allow_untested_optimizer")
    if stage >= 1 and name.lower() not in ZERO_TESTED_OPTIMIZERS and not untested_allowed:
        problems.append(f"optimizer.type={kind!r} with ZeRO stage {stage}: DeepSpeed runs ZeRO with Adam, "
                        "AdamW, Adagrad, Lion or Muon only, unless zero_allow_untested_optimizer is true; "
                        "set zero_allow_untested_optimizer: true or choose one of those")


def scheduler_problems(ds_config: Mapping[str, Any]) -> list[str]:
    """``scheduler``: a type DeepSpeed finds, and ``params`` its constructor takes (DeepSpeed calls
    ``type(optimizer, **params)``: missing ``params``, a missing required argument or an unknown one
    fail there)."""
    section = ds_config.get("scheduler")
    if section is None:
        return []
    if not is_mapping(section):
        return [f"scheduler={section!r:.80}: expected a mapping such as {{type: WarmupLR, params: {{}}}}"]
    kind = section.get("type")
    if kind is None:
        return []
    allowed: set[str] | None
    if isinstance(kind, str) and kind in DS_SCHEDULERS:
        required_t, optional = DS_SCHEDULERS[kind]
        required, allowed = list(required_t), {*required_t, *optional}
    else:
        cls = _torch_attr("torch.optim.lr_scheduler", kind) if isinstance(kind, str) else None
        if cls is None:
            return [f"scheduler.type={kind!r}: DeepSpeed does not recognize it; expected one of "
                    f"{', '.join(DS_SCHEDULERS)} or a torch.optim.lr_scheduler class such as 'StepLR'"]
        allowed, required = _signature_names(cls)
    params = section.get("params")
    if not is_mapping(params):
        return [f"scheduler.params={params!r:.80}: DeepSpeed calls {kind}(optimizer, **params), so params "
                f"must be a mapping (write params: {{}} for no arguments)"
                + (f"; {kind} requires {', '.join(required)}" if required else "")]
    problems = [f"scheduler.params.{name} is missing: {kind} requires it"
                for name in required if name not in params]
    problems += [f"scheduler.params.{name}: not an argument of {kind}; expected some of "
                 f"{', '.join(sorted(allowed))}"
                 for name in params if allowed is not None and name not in allowed]
    steps = params.get("warmup_num_steps", 1)
    if kind in _WARMUP_SCHEDULERS and (not isinstance(steps, int) or steps <= 0) and steps != "auto":
        problems.append(f"scheduler.params.warmup_num_steps={steps!r}: {kind} needs a positive integer")
    return problems


def communication_problems(ds_config: Mapping[str, Any], *, stage: int, zero: Mapping[str, Any]) -> list[str]:
    """The gradient reduction: data types, the all-reduce op, and what ZeRO 2/3's reduce-scatter refuses."""
    problems = []
    for key in ("communication_data_type", "seq_parallel_communication_data_type"):
        value = ds_config.get(key)
        if value is not None and value != "auto" and (
                not isinstance(value, str) or value.lower() not in ("fp16", "bf16", "fp32")):
            problems.append(f"{key}={value!r}: DeepSpeed supports 'fp16', 'bf16' or 'fp32'")
    op = ds_config.get("gradient_allreduce_op", "mean")
    op = op.lower() if isinstance(op, str) else op
    if op not in ("mean", "sum"):
        problems.append(f"gradient_allreduce_op={op!r}: DeepSpeed supports 'mean' or 'sum'")
    elif op == "sum" and stage == 3:
        problems.append("gradient_allreduce_op='sum' with ZeRO stage 3: DeepSpeed does not support it; use "
                        "'mean' or stage 0-2")
    if stage in (2, 3) and zero.get("reduce_scatter", True):
        fix = "or set zero_optimization.reduce_scatter to false"
        if ds_config.get("prescale_gradients"):
            problems.append(f"prescale_gradients=true with ZeRO stage {stage}: DeepSpeed's stage {stage} "
                            "reduce-scatter does not support pre-scaling; set prescale_gradients to false "
                            f"{fix}")
        factor = ds_config.get("gradient_predivide_factor", 1.0)
        if is_number(factor) and factor != 1.0:
            problems.append(f"gradient_predivide_factor={factor!r} with ZeRO stage {stage}: DeepSpeed's "
                            f"stage {stage} reduce-scatter supports only 1.0; remove it {fix}")
    return problems


def checkpoint_problems(ds_config: Mapping[str, Any]) -> list[str]:
    """``checkpoint``: the values ``runtime/config.py`` and ``model_checkpointing/config.py`` check."""
    section = ds_config.get("checkpoint")
    if section is None:
        return []
    if not is_mapping(section):
        return [f"checkpoint={section!r:.80}: expected a mapping such as {{tag_validation: Warn}}"]
    problems = []
    checks = [("checkpoint.tag_validation", section.get("tag_validation", "Warn"),
               ("WARN", "IGNORE", "FAIL"))]
    writer = section.get("writer")
    if is_mapping(writer):
        checks += [("checkpoint.writer.type", writer.get("type", "PYTHON"), ("MOCK", "PYTHON", "FAST")),
                   ("checkpoint.writer.data_parallel", writer.get("data_parallel", "REPLICA"),
                    ("REPLICA", "SOCKET", "MACHINE"))]
    for key, value, allowed in checks:
        if not isinstance(value, str) or value.upper() not in allowed:
            problems.append(f"{key}={value!r}: DeepSpeed expects one of {', '.join(allowed)} (any case)")
    parallel = section.get("parallel_write", {})
    stage_flag = parallel.get("pipeline_stage", False) if is_mapping(parallel) else False
    if stage_flag not in (True, False):
        problems.append(f"checkpoint.parallel_write.pipeline_stage={stage_flag!r}: DeepSpeed expects true "
                        "or false")
    return problems
