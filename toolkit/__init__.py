"""toolkit: small, composable helpers for PyTorch + DeepSpeed training loops you write yourself.

Launch your loop with ``torchrun`` or ``deepspeed``; import what you need::

    # torchrun --nproc_per_node 2 train.py
    import toolkit
    ctx = toolkit.init_distributed()                       # call on all ranks
    hparams = toolkit.get_hparams("deepspeed.yaml")
    ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size)
"""

from toolkit.config import (
    EXPERIMENT_CONFIG_ENV,
    TRIAL_HPARAMS_ENV,
    ConfigWarning,
    get_hparams,
    load_experiment_config,
)
from toolkit.distributed import DistributedContext, get_context, init_distributed
from toolkit.ds_config import (
    build_ds_config,
    get_ds_config_from_hparams,
    overwrite_deepspeed_config,
    resolve_ds_config,
    validate_ds_config,
)
from toolkit.errors import CheckpointError, ConfigError, LaunchEnvError

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ConfigWarning",
    "DistributedContext",
    "EXPERIMENT_CONFIG_ENV",
    "LaunchEnvError",
    "TRIAL_HPARAMS_ENV",
    "build_ds_config",
    "get_context",
    "get_ds_config_from_hparams",
    "get_hparams",
    "init_distributed",
    "load_experiment_config",
    "overwrite_deepspeed_config",
    "resolve_ds_config",
    "validate_ds_config",
]
