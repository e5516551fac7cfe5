"""Experiment YAML and DeepSpeed configs: load, merge, resolve, validate (docs/configs.md).

Pure apart from reading the named files; any rank; inputs are never mutated. Every wrong config
is one :class:`toolkit.ConfigError` listing every problem, raised before anything is launched.
"""

from toolkit.config.deepspeed import (
    build_ds_config,
    get_ds_config_from_hparams,
    overwrite_deepspeed_config,
    resolve_ds_config,
    validate_ds_config,
)
from toolkit.config.experiment import (
    EXPERIMENT_CONFIG_ENV,
    OUTPUT_DIR_ENV,
    TRIAL_HPARAMS_ENV,
    ConfigWarning,
    get_hparams,
    get_output_dir,
    load_experiment_config,
    max_length_steps,
)

__all__ = [
    "EXPERIMENT_CONFIG_ENV",
    "OUTPUT_DIR_ENV",
    "TRIAL_HPARAMS_ENV",
    "ConfigWarning",
    "build_ds_config",
    "get_ds_config_from_hparams",
    "get_hparams",
    "get_output_dir",
    "load_experiment_config",
    "max_length_steps",
    "overwrite_deepspeed_config",
    "resolve_ds_config",
    "validate_ds_config",
]
