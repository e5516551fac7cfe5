"""What a DeepSpeed config is, for every module of :mod:`toolkit.config`: the keys DeepSpeed reads,
the batch triple, the ZeRO stage, and the check that a config is a mapping at all. Pure; any rank.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from toolkit._checks import is_int, is_mapping, type_name
from toolkit.errors import ConfigError

__all__ = [
    "BATCH_KEYS",
    "DS_CONFIG_EXPECTED",
    "DS_TOP_LEVEL_KEYS",
    "AUTO_DROPPING_SECTIONS",
    "DS_OPTIMIZERS",
    "DS_SCHEDULERS",
    "FUSED_ADAM_KWARGS",
    "CPU_ADAM_KWARGS",
    "GAS",
    "MODEL_SECTION_KEYS",
    "REMOVED_TOP_LEVEL_KEYS",
    "REMOVED_ZERO_KEYS",
    "ZERO_TESTED_OPTIMIZERS",
    "MBS",
    "OFFLOAD_DEVICES",
    "TBS",
    "TESTED_DEEPSPEED",
    "batch_relation_problem",
    "tested_deepspeed_range",
    "mapping_problem",
    "plain_copy",
    "require_mapping",
    "stage_value",
    "zero_stage",
]

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
BATCH_KEYS = (TBS, MBS, GAS)

#: The DeepSpeed releases whose rules the validator mirrors, tested: major.minor from the first
#: (included) to the second (excluded). setup.cfg names the same range (tests/config checks it).
#: Under another release the validator warns once and turns DeepSpeed's refusals into warnings.
TESTED_DEEPSPEED = ((0, 19), (0, 20))

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

_REMOVED = "DeepSpeed 0.19 removed it (deepspeedai/DeepSpeed issue 8489) and refuses a config that has it"
#: Top-level keys DeepSpeed 0.19 refuses outright (``_REMOVED_TOP_LEVEL_CONFIG_KEYS``), with the fix.
REMOVED_TOP_LEVEL_KEYS = {
    "amp": f"NVIDIA Apex AMP: {_REMOVED}, even with enabled=false; use 'bf16', 'fp16' or 'torch_autocast'",
    "nebula": f"Nebula checkpointing: {_REMOVED}; remove the section",
    "compression_training": f"the compression library: {_REMOVED}; remove the section",
    "quantize_training": f"MoQ quantize_training: {_REMOVED}; remove the section",
    "sparse_gradients": f"sparse embedding-gradient compression: {_REMOVED}; remove the key",
    "eigenvalue": f"eigenvalue MoQ: {_REMOVED}; remove the section",
    "sparse_attention": f"DeepSpeed Sparse Attention: {_REMOVED}; remove the section",
    "elasticity": f"elastic training: {_REMOVED}; set the batch keys directly",
    "graph_harvesting": f"graph harvesting: {_REMOVED}; remove the key",
    "curriculum_learning": f"top-level curriculum learning: {_REMOVED}; use "
                           "data_efficiency.data_sampling.curriculum_learning",
    "progressive_layer_drop": f"progressive layer dropping: {_REMOVED}; remove the section",
}
#: ``zero_optimization`` keys DeepSpeed 0.19 refuses outright (``_REMOVED_ZERO_CONFIG_KEYS``).
REMOVED_ZERO_KEYS = {
    "mics_shard_size": f"MiCS sharding: {_REMOVED}; remove the key",
    "mics_hierarchical_params_gather": f"MiCS sharding: {_REMOVED}; remove the key",
    "zeropp_loco_param": f"LoCo-ZeRO++: {_REMOVED}; remove the key",
}

_OFFLOAD_COMMON = ("device", "nvme_path", "buffer_count", "pin_memory")
_BF16_KEYS = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow",
                        "bf16_master_weights_and_grads", "bf16_optimizer_states"})
#: The keys of the sections DeepSpeed 0.19 reads into its config models (field names and aliases of
#: DeepSpeedZeroConfig, the two offload configs, DeepSpeedFP16Config and DeepSpeedBF16Config). Those
#: models forbid any other key. tests/config/test_ds_verdicts.py checks the lists against the installed
#: DeepSpeed.
MODEL_SECTION_KEYS: dict[str, frozenset[str]] = {
    "zero_optimization": frozenset({
        "stage", "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
        "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
        "elastic_checkpoint", "enable_sanity_checks", "gather_16bit_weights_on_model_save",
        "ignore_unused_parameters", "leaf_module", "legacy_stage1", "load_from_fp32_weights",
        "log_trace_cache_warnings", "max_live_parameters", "max_reuse_distance", "memory_efficient_linear",
        "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer", "offload_param",
        "overlap_comm", "override_module_apply", "param_persistence_threshold", "parameter_alignment",
        "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter",
        "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage3_allgather_sequential",
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
        "stage3_module_granularity_threshold", "stage3_param_persistence_threshold",
        "stage3_prefetch_bucket_size", "stage3_use_all_reduce_for_fetch_params", "sub_group_size",
        "use_all_reduce_for_fetch_params", "use_multi_rank_bucket_allreduce", "zenflow",
        "zero_hpz_partition_size", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
        "zero_quantized_weights"}),
    "zero_optimization.offload_param": frozenset({*_OFFLOAD_COMMON, "buffer_size", "max_in_cpu"}),
    "zero_optimization.offload_optimizer": frozenset({
        *_OFFLOAD_COMMON, "pipeline_read", "pipeline_write", "fast_init", "ratio", "super_offload",
        "cpuadam_cores_perc"}),
    "fp16": frozenset({"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                       "hysteresis", "consecutive_hysteresis", "min_loss_scale",
                       "fp16_master_weights_and_grads"}),
    "bf16": _BF16_KEYS,
    "bfloat16": _BF16_KEYS,
}
#: Sections built by DeepSpeed's config models, which drop an "auto" value they are given (at any
#: depth) and keep their default: such an "auto" is ignored, not an error.
AUTO_DROPPING_SECTIONS = ("zero_optimization", "fp16", "bf16", "bfloat16")

#: ``optimizer.type`` values DeepSpeed 0.19 builds itself (compared lower-cased); any other type is
#: looked up, case and all, in ``torch.optim``.
DS_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
#: The optimizers ZeRO (stage >= 1) runs without ``zero_allow_untested_optimizer`` (DeepSpeed's
#: ``ZERO_SUPPORTED_OPTIMIZERS``, by the ``optimizer.type`` that builds them).
ZERO_TESTED_OPTIMIZERS = ("adam", "adamw", "adagrad", "lion", "muon")
#: The keyword arguments of DeepSpeed's Adam kernels that ``optimizer.params`` may set (DeepSpeed
#: passes the mode itself; ``adam_w_mode``, ``torch_adam`` and ``fp32_optimizer_states`` it reads first).
FUSED_ADAM_KWARGS = ("lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "set_grad_none")
CPU_ADAM_KWARGS = ("lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad")
#: DeepSpeed's own LR schedulers: (required params, optional params) of each constructor.
DS_SCHEDULERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "LRRangeTest": ((), ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                         "lr_range_test_staircase", "last_batch_iteration")),
    "OneCycle": (("cycle_min_lr", "cycle_max_lr"),
                 ("decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                  "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                  "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration")),
    "WarmupLR": ((), ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration")),
    "WarmupDecayLR": (("total_num_steps",), ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                             "warmup_type", "last_batch_iteration")),
    "WarmupCosineLR": (("total_num_steps",), ("warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                                              "warmup_type", "last_batch_iteration")),
}

#: The message for a config argument that is not a mapping (``ds_config``, ``hparams``, ...).
DS_CONFIG_EXPECTED = "a dict of DeepSpeed keys"

#: What ``zero_optimization.offload_param.device`` and ``offload_optimizer.device`` may be.
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def mapping_problem(value: Any, name: str, expected: str) -> str | None:
    """The sentence saying ``value`` is not a mapping, or None when it is one. Pure; any rank."""
    if is_mapping(value):
        return None
    return f"{name}={value!r:.80}: expected {expected}, got {type_name(value)}"


def require_mapping(value: Any, name: str, expected: str) -> Mapping[str, Any]:
    """``value`` when it is a mapping, else ConfigError naming ``name`` and ``expected``. Pure; any rank.

    Never TypeError: a file may hold a list at the top, and that is still the user's config.
    """
    problem = mapping_problem(value, name, expected)
    if problem:
        raise ConfigError(problem)
    return value


def plain_copy(config: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy in which every nested mapping is a plain ``dict``. Pure; any rank."""
    return {key: plain_copy(value) if is_mapping(value) else copy.deepcopy(value)
            for key, value in config.items()}


def stage_value(raw: Any) -> int | None:
    """A ZeRO stage as DeepSpeed's config model reads it (0..3, also as a bool, an integral float or a
    numeric string: pydantic's lax mode), or None. Pure; any rank."""
    if isinstance(raw, str):
        raw = raw.strip()
        raw = int(raw) if raw.isdigit() else None
    elif isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, bool) or is_int(raw):
        return int(raw) if 0 <= int(raw) <= 3 else None
    return None


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    """The ZeRO stage a config asks for: 0 without ``zero_optimization``, 1 for DeepSpeed's legacy
    ``true``, -1 when :func:`stage_value` cannot read it. Pure; any rank."""
    zero: Any = ds_config.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true means stage 1
        return int(zero)
    if is_mapping(zero):
        stage = stage_value(zero.get("stage", 0))
        return -1 if stage is None else stage
    return 0


def batch_relation_problem(tbs: int, mbs: int, gas: int, dp: int) -> str | None:
    """The sentence saying the batch triple breaks ``tbs == mbs * gas * dp`` and how to fix it, or
    None when it holds. Pure; any rank."""
    if tbs == mbs * gas * dp:
        return None
    return (f"batch sizes do not add up: {TBS}={tbs} but {MBS}={mbs} x {GAS}={gas} x "
            f"data_parallel_size={dp} = {mbs * gas * dp}; set {TBS} to {mbs * gas * dp} "
            f"(= {mbs} x {gas} x {dp}), or choose {MBS} and {GAS} whose product times {dp} is {tbs}")


def tested_deepspeed_range() -> str:
    """:data:`TESTED_DEEPSPEED` as a requirement specifier, ``'>=0.19,<0.20'``. Pure."""
    (low_major, low_minor), (high_major, high_minor) = TESTED_DEEPSPEED
    return f">={low_major}.{low_minor},<{high_major}.{high_minor}"
