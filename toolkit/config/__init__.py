"""Experiment YAML and DeepSpeed configs: load, merge, resolve, validate.

Pure (apart from reading the named files), any rank, and no function mutates its inputs. Every
wrong config, hyperparameter or argument, a config that is not a mapping included, raises one
:class:`toolkit.ConfigError` listing every problem (the rule of :mod:`toolkit.errors`), before
anything is launched. What is accepted, warned about and refused: docs/configs.md.

Example::

    hparams = get_hparams("deepspeed.yaml")                      # any rank
    ds_config = build_ds_config(hparams, data_parallel_size=2)  # same result on every rank
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
