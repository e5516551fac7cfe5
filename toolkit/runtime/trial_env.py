"""The ``TOOLKIT_*`` variables that toolkit's launchers (dsat, ``python -m toolkit.run``) set for the
processes they start and the core library reads in them. Constants only; they live below
``config/``, ``runtime/`` and the launchers, so that a training script need not load the tuner."""

from __future__ import annotations

__all__ = ["BUILD_GUARDS_ENV", "EXPERIMENT_CONFIG_ENV", "OUTPUT_DIR_ENV", "RUN_ENV", "TRIAL_ENV",
           "TRIAL_HPARAMS_ENV"]

#: Path of a JSON file holding this trial's hyperparameters; set by the dsat trial runner.
TRIAL_HPARAMS_ENV = "TOOLKIT_TRIAL_HPARAMS"
#: Path of the experiment YAML; used by :func:`toolkit.get_hparams` when no path is passed.
EXPERIMENT_CONFIG_ENV = "TOOLKIT_EXPERIMENT_CONFIG"
#: Directory a run writes its checkpoints and TensorBoard logs to; set by dsat for each trial (its
#: own trial directory) and for the full experiment, so they never touch the user's own runs.
OUTPUT_DIR_ENV = "TOOLKIT_OUTPUT_DIR"
#: The trial's :class:`~toolkit.dsat.contract.TrialContract` JSON file; also the mark of a trial's processes.
TRIAL_ENV = "TOOLKIT_DSAT_TRIAL"
#: Marks every process of one run that is not a trial (its value: the run's mark).
RUN_ENV = "TOOLKIT_DSAT_RUN"
#: "1" in the processes ``python -m toolkit.run`` starts: importing ``toolkit.compat.determined``
#: installs the op-build guards, since a Determined script may call ``deepspeed.init_distributed()``
#: (which loads an op on CPU) before anything of toolkit's.
BUILD_GUARDS_ENV = "TOOLKIT_BUILD_GUARDS"
