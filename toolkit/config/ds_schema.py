"""What a DeepSpeed config is, for every module of this package: the keys DeepSpeed reads, the batch
triple and its relation, the ZeRO stage, and the one check that a config is a mapping at all.

Pure; any rank. Nothing here mutates its input.

Errors follow :mod:`toolkit.errors`: a DeepSpeed config, hyperparameters or any other argument that
carries configuration is the user's value even when it is not a mapping at all (a JSON or YAML file
may hold a list at the top, and the caller cannot always tell), so :func:`require_mapping` raises
:class:`~toolkit.errors.ConfigError`, never ``TypeError``. Every public function of
:mod:`toolkit.config` follows it, so a script catches one type for "this config is wrong".

Example::

    ds_config = require_mapping(ds_config, "ds_config", "a dict of DeepSpeed keys")  # ConfigError if not
    if zero_stage(ds_config) == 3:
        ...
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
    "GAS",
    "MBS",
    "OFFLOAD_DEVICES",
    "TBS",
    "batch_relation_problem",
    "mapping_problem",
    "plain_copy",
    "require_mapping",
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

#: The message for a config argument that is not a mapping (``ds_config``, ``hparams``, ...).
DS_CONFIG_EXPECTED = "a dict of DeepSpeed keys"

#: What ``zero_optimization.offload_param.device`` and ``offload_optimizer.device`` may be.
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def mapping_problem(value: Any, name: str, expected: str) -> str | None:
    """The sentence saying ``value`` is not a mapping, or None when it is one. Pure; any rank.

    Example:
        >>> mapping_problem(3, "hparams", "a dict of hyperparameters")
        'hparams=3: expected a dict of hyperparameters, got int'
    """
    if is_mapping(value):
        return None
    return f"{name}={value!r:.80}: expected {expected}, got {type_name(value)}"


def require_mapping(value: Any, name: str, expected: str) -> Mapping[str, Any]:
    """``value`` itself when it is a mapping, else :class:`ConfigError`. Pure; any rank.

    Args:
        name: the argument or key, as the user knows it (``"ds_config"``, ``"hparams"``).
        expected: what it should be, for the message (``"a dict of DeepSpeed keys"``).

    Example:
        >>> try:
        ...     require_mapping([1], "ds_config", "a dict of DeepSpeed keys")
        ... except ConfigError as err:
        ...     err.problems
        ['ds_config=[1]: expected a dict of DeepSpeed keys, got list']
    """
    problem = mapping_problem(value, name, expected)
    if problem:
        raise ConfigError(problem)
    return value


def plain_copy(config: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy in which every nested mapping is a plain ``dict``. Pure; any rank.

    Example:
        >>> plain_copy({"zero_optimization": {"stage": 1}})
        {'zero_optimization': {'stage': 1}}
    """
    return {key: plain_copy(value) if is_mapping(value) else copy.deepcopy(value)
            for key, value in config.items()}


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    """The ZeRO stage a config asks for: 0 when ``zero_optimization`` is absent, -1 when the stage
    is not an integer. Pure; any rank.

    Example:
        >>> zero_stage({"zero_optimization": True})  # DeepSpeed's legacy form: stage 1
        1
    """
    zero: Any = ds_config.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true means stage 1
        return int(zero)
    if is_mapping(zero):
        stage = zero.get("stage", 0)
        return int(stage) if is_int(stage) else -1
    return 0


def batch_relation_problem(tbs: int, mbs: int, gas: int, dp: int) -> str | None:
    """The sentence saying the batch triple breaks ``tbs == mbs * gas * dp`` and how to fix it, or
    None when it holds. Pure; any rank.

    Example:
        >>> batch_relation_problem(8, 2, 2, 2) is None
        True
    """
    if tbs == mbs * gas * dp:
        return None
    return (f"batch sizes do not add up: {TBS}={tbs} but {MBS}={mbs} x {GAS}={gas} x "
            f"data_parallel_size={dp} = {mbs * gas * dp}; set {TBS} to {mbs * gas * dp} "
            f"(= {mbs} x {gas} x {dp}), or choose {MBS} and {GAS} whose product times {dp} is {tbs}")
