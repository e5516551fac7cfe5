"""Experiment YAML and DeepSpeed configs: load, merge, resolve, validate.

Modules, one concern each:

* ``experiment``: the experiment YAML, hyperparameters, unknown-key warnings;
* ``ds_schema``: what a DeepSpeed config is (key names, the batch triple, the mapping check);
* ``deepspeed``: load and merge DeepSpeed configs, and :func:`build_ds_config` (re-exports the
  names of the two below, so ``toolkit.config.deepspeed`` keeps its public names);
* ``resolve``: "auto" values and the exact batch triple;
* ``validate``: what DeepSpeed cannot run, every problem at once, with ``ds_engine_rules`` (the
  optimizer, scheduler, communication and checkpoint rules DeepSpeed's engine applies).

Everything here is pure (apart from reading the named files) and any rank may call it; no function
mutates its inputs. Every wrong config, hyperparameter or argument, a config that is not a mapping
included, raises :class:`toolkit.ConfigError` listing every problem (the rule of
:mod:`toolkit.errors`).

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
