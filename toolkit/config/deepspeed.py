"""DeepSpeed configs: load, merge, resolve "auto" and the batch triple, validate before launch.

DeepSpeed configs stay plain dicts and are never mutated: every function here returns a new dict.
The usual path from hyperparameters to a runnable config is :func:`build_ds_config`::

    # torchrun --nproc_per_node 2 train.py
    ctx = toolkit.init_distributed()
    hparams = toolkit.get_hparams("deepspeed.yaml")
    ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size,
                                        base_dir=Path(__file__).parent, device=ctx.device)

which is :func:`get_ds_config_from_hparams`, then :func:`resolve_ds_config`, then
:func:`validate_ds_config`.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import is_int
from toolkit.config.experiment import warn_unknown_keys
from toolkit.errors import ConfigError

__all__ = [
    "BATCH_KEYS",
    "DS_TOP_LEVEL_KEYS",
    "load_json_strict",
    "overwrite_deepspeed_config",
    "get_ds_config_from_hparams",
    "resolve_ds_config",
    "validate_ds_config",
    "build_ds_config",
    "zero_stage",
]

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
BATCH_KEYS = (TBS, MBS, GAS)

#: Top-level keys DeepSpeed 0.19 reads (runtime/config.py and the feature configs it loads).
DS_TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "amp", "torch_autocast",
    "gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
    "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
    "flops_profiler", "activation_checkpointing", "aio", "tensorboard", "wandb", "csv_monitor",
    "comet", "comms_logger", "elasticity", "pipeline", "communication_data_type",
    "seq_parallel_communication_data_type", "data_types", "sparse_attention", "autotuning",
    "checkpoint", "data_efficiency", "curriculum_learning", "compression_training", "nebula",
    "eigenvalue", "progressive_layer_drop", "quantize_training", "disable_allgather",
    "dataloader_drop_last", "compile", "hybrid_engine", "weight_quantization",
    "use_data_before_expert_parallelism", "timers", "graph_harvesting", "mics_shard_size",
    "mics_hierarchical_params_gather", "load_universal_checkpoint", "use_node_local_storage",
    "gradient_accumulation_dtype", "tensor_parallel",
    "pipeline_stage", "disable_python_gc", "ds_precision",
})

# hyperparameters that are Determined conventions, not DeepSpeed keys.
_HPARAM_ONLY = ("deepspeed_config", "overwrite_deepspeed_args", "global_batch_size",
                "data_parallel_world_size")
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")



def _reject_duplicates(source: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"duplicate key {key!r} (values {out[key]!r} and {value!r}); "
                                  "JSON keeps only the last one silently, so remove one of them",
                                  source=source)
            out[key] = value
        return out
    return hook


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_json_strict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a JSON object, rejecting duplicate keys and NaN/Infinity. Any rank.

    Raises:
        FileNotFoundError: naming the absolute path looked at.
        ConfigError: malformed JSON (line and column), a duplicate key, or a non-object.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"DeepSpeed config {str(path)!r} not found (looked at {file.resolve()})")
    text = file.read_text(encoding="utf-8")
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates(str(path)),
                          parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(f"malformed JSON at line {err.lineno}, column {err.colno}: {err.msg}",
                          source=str(path)) from None
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err), source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object at the top, got {type(data).__name__}", source=str(path))
    return data


def _merge(base: dict[str, Any], source: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in source.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value) if not isinstance(value, Mapping) else _merge({}, value)
    return out


def overwrite_deepspeed_config(base_ds_config: str | os.PathLike[str] | Mapping[str, Any],
                               source_ds_dict: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge ``source_ds_dict`` into a DeepSpeed config, recursively; the source wins. Any rank.

    Nested mappings are merged key by key, anything else (numbers, lists) is replaced, and keys
    only in the source are added. Neither input is modified.

    Args:
        base_ds_config: a path to a JSON file (duplicate keys rejected) or a mapping.
        source_ds_dict: the values that win, e.g. ``hparams["overwrite_deepspeed_args"]``;
            ``None`` means nothing to overwrite.

    Returns:
        A new dict.

    Raises:
        TypeError: ``base_ds_config`` is neither a path nor a mapping, or the source is not a
            mapping.

    Example:
        >>> overwrite_deepspeed_config({"optimizer": {"params": {"lr": 1e-3, "eps": 1e-8}}},
        ...                            {"optimizer": {"params": {"lr": 5e-3}}})
        {'optimizer': {'params': {'lr': 0.005, 'eps': 1e-08}}}
    """
    if isinstance(base_ds_config, (str, os.PathLike)):
        base = load_json_strict(base_ds_config)
    elif isinstance(base_ds_config, Mapping):
        base = _merge({}, base_ds_config)
    else:
        raise TypeError(f"base_ds_config must be a path to a JSON file or a dict, got "
                        f"{type(base_ds_config).__name__}: {base_ds_config!r:.80}")
    if source_ds_dict is None:
        return base
    if not isinstance(source_ds_dict, Mapping):
        raise TypeError(f"source_ds_dict must be a dict of DeepSpeed keys, got "
                        f"{type(source_ds_dict).__name__}: {source_ds_dict!r:.80}")
    return _merge(base, source_ds_dict)


def get_ds_config_from_hparams(hparams: Mapping[str, Any], base_dir: str | os.PathLike[str] = ".",
                               ) -> dict[str, Any]:
    """The DeepSpeed config named or written in the hyperparameters. Any rank.

    Two forms, as in Determined:

    * ``deepspeed_config: ds_config.json`` (relative to ``base_dir``, not to the working
      directory unless ``base_dir`` is ``"."``), plus optional ``overwrite_deepspeed_args``
      merged on top;
    * no ``deepspeed_config``: the DeepSpeed keys written inline in the hyperparameters
      (``train_batch_size``, ``zero_optimization``, ...), plus ``overwrite_deepspeed_args``.

    Args:
        hparams: from :func:`toolkit.get_hparams`.
        base_dir: the directory relative paths are resolved against; scripts pass their own
            directory, ``Path(__file__).parent``, so they work from any working directory.

    Returns:
        A new dict; not yet resolved (see :func:`resolve_ds_config`).

    Raises:
        ConfigError: ``deepspeed_config`` has the wrong type, or neither form is present (the
            message lists the keys that were found).
        FileNotFoundError: the JSON file is missing (the message gives the path looked at).
    """
    if not isinstance(hparams, Mapping):
        raise TypeError(f"hparams must be a dict, got {type(hparams).__name__}")
    overwrite = hparams.get("overwrite_deepspeed_args")
    if overwrite is not None and not isinstance(overwrite, Mapping):
        raise ConfigError(f"hyperparameters.overwrite_deepspeed_args={overwrite!r:.80}: expected a mapping "
                          "of DeepSpeed keys to values")
    if "deepspeed_config" in hparams:
        name = hparams["deepspeed_config"]
        if isinstance(name, Mapping):
            base: Any = name
        elif isinstance(name, (str, os.PathLike)) and str(name):
            path = Path(name)
            base = path if path.is_absolute() else Path(base_dir) / path
        else:
            raise ConfigError(f"hyperparameters.deepspeed_config={name!r}: expected a path to a JSON file "
                              "such as 'ds_config.json'")
        return overwrite_deepspeed_config(base, overwrite)
    inline = {k: v for k, v in hparams.items() if k in DS_TOP_LEVEL_KEYS}
    if not inline and not overwrite:
        found = ", ".join(sorted(map(str, hparams))) or "none"
        raise ConfigError("hyperparameters have no 'deepspeed_config' key and no DeepSpeed keys written "
                          f"inline (found: {found}); add 'deepspeed_config: ds_config.json' or the "
                          "DeepSpeed keys themselves")
    return overwrite_deepspeed_config(inline, overwrite)


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    """The ZeRO stage a config asks for (0 when ``zero_optimization`` is absent). Any rank."""
    zero = ds_config.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true means stage 1
        return int(zero)
    if isinstance(zero, Mapping):
        stage = zero.get("stage", 0)
        return stage if is_int(stage) else -1
    return 0


def _positive_or_none(value: Any, key: str, problems: list[str]) -> int | None:
    if value is None or value == "auto":
        return None
    if not is_int(value) or value < 1:
        problems.append(f"{key}={value!r}: expected a positive integer")
        return None
    return value


def _fix_hint(tbs: int, mbs: int, gas: int, dp: int) -> str:
    return (f"set {TBS} to {mbs * gas * dp} (= {mbs} x {gas} x {dp}), or choose {MBS} and {GAS} "
            f"whose product times {dp} is {tbs}")


def resolve_ds_config(ds_config: Mapping[str, Any], *, data_parallel_size: int,
                      train_batch_size: int | None = None, micro_batch_size: int | None = None,
                      gradient_accumulation_steps: int | None = None,
                      hidden_size: int | None = None,
                      hparams: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Fill "auto" values and complete the batch triple exactly. Any rank.

    The batch keys follow DeepSpeed's own rules (``runtime/config.py``) for every combination
    given, but exactly: ``train_batch_size == train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * data_parallel_size`` holds afterwards, or :class:`ConfigError`
    says which numbers break it and how to fix them (DeepSpeed itself floors the division and
    trains with a different batch than asked).

    * A batch key that is missing or ``"auto"`` takes the keyword argument when given.
    * ``gradient_accumulation_steps: "auto"`` with nothing to derive it from is 1.
    * Given two of the three, the third is derived; given only ``train_batch_size``,
      accumulation is 1; given only the micro-batch, accumulation is 1.
    * ``hidden_size`` fills the model-size "auto" values of ZeRO the way HF Transformers does:
      ``reduce_bucket_size = h*h``, ``stage3_prefetch_bucket_size = 0.9*h*h``,
      ``stage3_param_persistence_threshold = 10*h``.
    * ``hparams`` with Determined's ``global_batch_size`` / ``data_parallel_world_size`` must
      agree with the result.

    Args:
        ds_config: the config (not modified).
        data_parallel_size: model replicas: world size / (pipeline stages x model parallel size).

    Returns:
        A new dict with all three batch keys set to positive integers.

    Raises:
        ConfigError: listing every problem.
    """
    if not is_int(data_parallel_size) or data_parallel_size < 1:
        raise ConfigError(f"data_parallel_size={data_parallel_size!r}: expected an integer >= 1")
    if not isinstance(ds_config, Mapping):
        raise TypeError(f"ds_config must be a dict, got {type(ds_config).__name__}")
    out = _merge({}, ds_config)
    problems: list[str] = []
    args = {TBS: train_batch_size, MBS: micro_batch_size, GAS: gradient_accumulation_steps}
    values: dict[str, int | None] = {}
    for key, arg in args.items():
        arg = _positive_or_none(arg, f"argument for {key}", problems)
        current = _positive_or_none(out.get(key), key, problems)
        if current is not None and arg is not None and current != arg:
            problems.append(f"{key}={current} in the config but {arg} was passed; remove one of them")
        values[key] = current if current is not None else arg
    if problems:
        raise ConfigError(problems)

    tbs, mbs, gas = values[TBS], values[MBS], values[GAS]
    dp = data_parallel_size
    if tbs is None and mbs is None:
        raise ConfigError(f"neither {TBS} nor {MBS} is given (found {TBS}={out.get(TBS)!r}, "
                          f"{MBS}={out.get(MBS)!r}, {GAS}={out.get(GAS)!r}); set at least one of them")
    if tbs is not None and mbs is not None and gas is None:
        if tbs % (mbs * dp):
            raise ConfigError(f"{TBS}={tbs} is not divisible by {MBS}={mbs} x data_parallel_size={dp} "
                              f"= {mbs * dp}; set {TBS} to a multiple of {mbs * dp}, e.g. "
                              f"{max(tbs // (mbs * dp), 1) * mbs * dp}")
        gas = tbs // (mbs * dp)
    elif tbs is not None and gas is not None and mbs is None:
        if tbs % (gas * dp):
            raise ConfigError(f"{TBS}={tbs} is not divisible by {GAS}={gas} x data_parallel_size={dp} "
                              f"= {gas * dp}; set {TBS} to a multiple of {gas * dp}")
        mbs = tbs // (gas * dp)
    elif tbs is None:
        gas = gas or 1
        tbs = mbs * gas * dp
    elif mbs is None:  # only train_batch_size
        gas = 1
        if tbs % dp:
            raise ConfigError(f"{TBS}={tbs} is not divisible by data_parallel_size={dp}; set it to a "
                              f"multiple of {dp}, e.g. {max(tbs // dp, 1) * dp}")
        mbs = tbs // dp
    if tbs != mbs * gas * dp:
        raise ConfigError(f"batch sizes do not add up: {TBS}={tbs} but {MBS}={mbs} x {GAS}={gas} x "
                          f"data_parallel_size={dp} = {mbs * gas * dp}; {_fix_hint(tbs, mbs, gas, dp)}")
    out[TBS], out[MBS], out[GAS] = tbs, mbs, gas

    zero = out.get("zero_optimization")
    if isinstance(zero, dict) and hidden_size is not None:
        if not is_int(hidden_size) or hidden_size < 1:
            raise ConfigError(f"hidden_size={hidden_size!r}: expected a positive integer")
        fills = {"reduce_bucket_size": hidden_size * hidden_size,
                 "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                 "stage3_param_persistence_threshold": 10 * hidden_size}
        for key, value in fills.items():
            if zero.get(key) == "auto":
                zero[key] = value

    if hparams is not None:
        gbs = hparams.get("global_batch_size")
        if gbs is not None and gbs != tbs:
            problems.append(f"hyperparameters.global_batch_size={gbs!r} but the DeepSpeed config's {TBS} "
                            f"is {tbs}; make them equal")
        dpws = hparams.get("data_parallel_world_size")
        if dpws is not None and dpws != dp:
            problems.append(f"hyperparameters.data_parallel_world_size={dpws!r} but this run has "
                            f"data_parallel_size={dp}; launch {dpws} replicas or change the hyperparameter")
    if problems:
        raise ConfigError(problems)
    return out


def _find_auto(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, Mapping):
        found = []
        for key, value in node.items():
            found += _find_auto(value, f"{prefix}{key}.")
        return found
    return [prefix[:-1]] if node == "auto" else []


def _offload_device(zero: Mapping[str, Any], key: str, problems: list[str]) -> str:
    section = zero.get(key)
    if section is None:
        return "none"
    if not isinstance(section, Mapping):
        problems.append(f"zero_optimization.{key}={section!r}: expected a mapping such as {{device: cpu}}")
        return "none"
    device = section.get("device", "none")
    if device not in _OFFLOAD_DEVICES:
        problems.append(f"zero_optimization.{key}.device={device!r}: expected one of "
                        f"{', '.join(_OFFLOAD_DEVICES)}")
        return "none"
    return device


def _enabled(ds_config: Mapping[str, Any], *keys: str) -> bool:
    for key in keys:
        section = ds_config.get(key)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            return True
    return False


def validate_ds_config(ds_config: Mapping[str, Any], *, pipeline: bool = False,
                       device: Any = None, data_parallel_size: int | None = None) -> None:
    """Check a DeepSpeed config for what DeepSpeed cannot run, listing every problem. Any rank.

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
        ConfigError: listing every problem found.
    """
    if not isinstance(ds_config, Mapping):
        raise ConfigError(f"a DeepSpeed config must be a mapping, got {type(ds_config).__name__}")
    problems: list[str] = []
    warn_unknown_keys(ds_config, DS_TOP_LEVEL_KEYS, where="")

    zero = ds_config.get("zero_optimization", {})
    stage = 0
    if isinstance(zero, bool):
        stage = int(zero)
        zero = {}
    elif not isinstance(zero, Mapping):
        problems.append(f"zero_optimization={zero!r}: expected a mapping such as {{stage: 1}}")
        zero = {}
    else:
        raw = zero.get("stage", 0)
        if not is_int(raw) or not 0 <= raw <= 3:
            problems.append(f"zero_optimization.stage={raw!r}: expected 0, 1, 2 or 3")
        else:
            stage = raw

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

    fp16 = _enabled(ds_config, "fp16")
    bf16 = _enabled(ds_config, "bf16", "bfloat16")
    if fp16 and bf16:
        problems.append("fp16.enabled and bf16.enabled are both true: choose one precision")
    if fp16 and device is not None and str(device).split(":")[0] == "cpu":
        problems.append("fp16.enabled=true on a CPU device: DeepSpeed's CPU accelerator does not support "
                        "fp16; use bf16 or fp32 on CPU")

    numbers = {}
    for key in BATCH_KEYS:
        if key not in ds_config:
            continue
        value = ds_config[key]
        if value == "auto":
            continue  # reported with the other unresolved values below
        if not is_int(value) or value < 1:
            problems.append(f"{key}={value!r}: expected a positive integer")
        else:
            numbers[key] = value
    if len(numbers) == 3:
        tbs, mbs, gas = numbers[TBS], numbers[MBS], numbers[GAS]
        if data_parallel_size is not None:
            if tbs != mbs * gas * data_parallel_size:
                problems.append(f"batch sizes do not add up: {TBS}={tbs} but {MBS}={mbs} x {GAS}={gas} x "
                                f"data_parallel_size={data_parallel_size} = {mbs * gas * data_parallel_size}; "
                                f"{_fix_hint(tbs, mbs, gas, data_parallel_size)}")
        elif tbs % (mbs * gas):
            problems.append(f"{TBS}={tbs} is not a multiple of {MBS}={mbs} x {GAS}={gas} = {mbs * gas}, so "
                            "no data-parallel size satisfies the batch relation")

    for key in _find_auto(ds_config):
        problems.append(f"{key}='auto' is unresolved: call resolve_ds_config (with hidden_size= for ZeRO "
                        "bucket sizes) or write a number")
    if problems:
        raise ConfigError(problems)


def build_ds_config(hparams: Mapping[str, Any], *, data_parallel_size: int,
                    base_dir: str | os.PathLike[str] = ".", pipeline: bool = False,
                    device: Any = None, hidden_size: int | None = None) -> dict[str, Any]:
    """Hyperparameters to a complete, checked DeepSpeed config, in one call. Any rank.

    :func:`get_ds_config_from_hparams`, then :func:`resolve_ds_config` (with the hparams'
    ``global_batch_size`` / ``data_parallel_world_size`` checked), then
    :func:`validate_ds_config`.

    Example::

        # torchrun --nproc_per_node 2 train.py
        ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size,
                                            base_dir=Path(__file__).parent, device=ctx.device)
    """
    raw = get_ds_config_from_hparams(hparams, base_dir)
    resolved = resolve_ds_config(raw, data_parallel_size=data_parallel_size, hidden_size=hidden_size,
                                 hparams=hparams)
    validate_ds_config(resolved, pipeline=pipeline, device=device, data_parallel_size=data_parallel_size)
    return resolved
