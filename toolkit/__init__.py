"""toolkit: small, composable helpers for PyTorch + DeepSpeed training loops you write yourself.

Example (all ranks; ``torchrun --nproc_per_node 2 train.py``)::

    ctx = toolkit.init_distributed()
    hparams = toolkit.get_hparams("deepspeed.yaml")
    ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size)

A whole loop (metrics, checkpoints, preemption, dsat's reporting): ``examples/core_api/train.py``.
"""

from toolkit.checkpoint import consolidate_checkpoint, load_checkpoint, replay_cpu_adam_state, save_checkpoint
from toolkit.config import (
    EXPERIMENT_CONFIG_ENV,
    OUTPUT_DIR_ENV,
    TRIAL_HPARAMS_ENV,
    ConfigWarning,
    build_ds_config,
    get_ds_config_from_hparams,
    get_hparams,
    get_output_dir,
    load_experiment_config,
    max_length_steps,
    overwrite_deepspeed_config,
    resolve_ds_config,
    validate_ds_config,
)
from toolkit.data import (
    ResumableDistributedSampler,
    ResumePosition,
    micro_batches,
    resume_position,
    seed_everything,
)
from toolkit.dsat.trial import dsat_reporting_context
from toolkit.errors import (
    BuildLockError,
    CheckpointError,
    CheckpointLockError,
    ConfigError,
    LaunchEnvError,
    RunConflictError,
)
from toolkit.metrics import MetricsWriter
from toolkit.preemption import PreemptionWatcher, watch_preemption
from toolkit.runtime import DistributedContext, get_context, init_distributed, install_build_guards

__version__ = "0.1.0"

__all__ = [
    "BuildLockError",
    "CheckpointError",
    "CheckpointLockError",
    "ConfigError",
    "ConfigWarning",
    "DistributedContext",
    "EXPERIMENT_CONFIG_ENV",
    "LaunchEnvError",
    "MetricsWriter",
    "OUTPUT_DIR_ENV",
    "PreemptionWatcher",
    "ResumableDistributedSampler",
    "ResumePosition",
    "RunConflictError",
    "TRIAL_HPARAMS_ENV",
    "build_ds_config",
    "consolidate_checkpoint",
    "dsat_reporting_context",
    "get_context",
    "get_ds_config_from_hparams",
    "get_hparams",
    "get_output_dir",
    "init_distributed",
    "install_build_guards",
    "load_checkpoint",
    "load_experiment_config",
    "max_length_steps",
    "micro_batches",
    "overwrite_deepspeed_config",
    "replay_cpu_adam_state",
    "resolve_ds_config",
    "resume_position",
    "save_checkpoint",
    "seed_everything",
    "validate_ds_config",
    "watch_preemption",
]
